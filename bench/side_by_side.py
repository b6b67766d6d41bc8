"""Canopy's CPU engine against JAX (and NumPy's OpenBLAS), side by side.

Runs `canopy model bench --backend cpu --json` and `bench/jax_baselines.py`
in turn, RUNS times each, interleaved (Canopy, JAX, Canopy, JAX, ...) so
that both see the same machine state, and prints per workload the ratio
Canopy/JAX of each pair, their median and range, and the node counts of
each training step before and after the CPU's fusion. `--json` prints one
JSON object instead.

    cargo build --release --bin canopy
    pip install "jax[cpu]" numpy
    python3 bench/side_by_side.py [--runs 3] [--json]
"""
import argparse, json, pathlib, statistics, subprocess, sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKLOADS = [
    ("mlp", "mlp_train_samples_per_s", "MLP 784-128-10 training (samples/s)"),
    ("lenet5", "lenet5_train_samples_per_s", "LeNet-5 training (samples/s)"),
    ("charlm", "charlm_train_samples_per_s", "charlm GRU 256, sequence 80 (samples/s)"),
    ("matmul 1024", ("matmul_gflops", "1024"), "matmul 1024 (GFLOPS; baseline NumPy/OpenBLAS)"),
    ("matmul 256", ("matmul_gflops", "256"), "matmul 256 (GFLOPS; baseline NumPy/OpenBLAS)"),
]


def figure(report, key):
    if isinstance(key, tuple):
        return report[key[0]][key[1]]
    return report[key]


def run_json(command):
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: `{' '.join(command)}` failed ({done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--canopy", default=str(ROOT / "target/release/canopy"))
    args = parser.parse_args()
    canopy, jax = [], []
    for run in range(args.runs):
        print(f"run {run + 1}/{args.runs}", file=sys.stderr)
        canopy.append(run_json([args.canopy, "model", "bench", "--backend", "cpu", "--json"]))
        jax.append(run_json([sys.executable, str(ROOT / "bench/jax_baselines.py")]))
    results = {}
    for name, key, label in WORKLOADS:
        ratios = [figure(c, key) / figure(j, key) for c, j in zip(canopy, jax)]
        results[name] = {
            "label": label,
            "canopy": [figure(c, key) for c in canopy],
            "baseline": [figure(j, key) for j in jax],
            "ratios": ratios,
            "median_ratio": statistics.median(ratios),
        }
    fusion = canopy[-1].get("train_step_cpu_fusion", {})
    if args.json:
        print(json.dumps({"runs": args.runs, "workloads": results, "fusion": fusion,
                          "jax_version": jax[-1]["jax_version"], "threads": canopy[-1]["threads"]}))
        return
    print(f"{args.runs} interleaved runs, {canopy[-1]['threads']} threads, JAX {jax[-1]['jax_version']}")
    print(f"{'workload':<48} {'median':>8} {'range':>15}")
    for result in results.values():
        low, high = min(result["ratios"]), max(result["ratios"])
        print(f"{result['label']:<48} {result['median_ratio']:>7.2f}x {low:>6.2f}x-{high:.2f}x")
    for name, counts in fusion.items():
        print(f"{name} train_step on the CPU: {counts['nodes']} nodes, {counts['after_fusion']} after fusion")


if __name__ == "__main__":
    main()

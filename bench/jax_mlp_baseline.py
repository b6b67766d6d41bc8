"""JAX/XLA baseline for `canopy model bench`'s MLP workload.

MLP 784-128-10, 5 epochs over the mnist-10k train split, shuffled, batch 64
(short final batch dropped, as `canopy model bench` does), SGD lr 0.1, a
jit-compiled training step. Start-up (data loading, compilation) is not
timed. Prints one JSON line.

    pip install "jax[cpu]" numpy && python3 bench/jax_mlp_baseline.py
"""
import gzip, json, pathlib, sys, time

import jax
import jax.numpy as jnp
import numpy as np

DATA = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "datasets/mnist-10k")
EPOCHS, BATCH, LR = 5, 64, 0.1


def idx(path, header):
    raw = gzip.open(path).read()
    return np.frombuffer(raw, dtype=np.uint8, offset=header)


x = idx(DATA / "train-images-idx3-ubyte.gz", 16).reshape(-1, 784).astype(np.float32) / 255.0
y = idx(DATA / "train-labels-idx1-ubyte.gz", 8).astype(np.int32)
x = (x - x.mean()) / x.std()

key = jax.random.PRNGKey(0)
k1, k2 = jax.random.split(key)
bound1, bound2 = 1 / np.sqrt(784), 1 / np.sqrt(128)
params = [
    jax.random.uniform(k1, (784, 128), minval=-bound1, maxval=bound1),
    jnp.zeros(128),
    jax.random.uniform(k2, (128, 10), minval=-bound2, maxval=bound2),
    jnp.zeros(10),
]


def loss(p, xb, yb):
    h = jax.nn.relu(xb @ p[0] + p[1])
    logits = h @ p[2] + p[3]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), yb[:, None], 1))


@jax.jit
def step(p, xb, yb):
    value, grads = jax.value_and_grad(loss)(p, xb, yb)
    return [w - LR * g for w, g in zip(p, grads)], value


rng = np.random.default_rng(0)
batches_per_epoch = len(x) // BATCH
step(params, x[:BATCH], y[:BATCH])[1].block_until_ready()  # compile
start = time.perf_counter()
for epoch in range(EPOCHS):
    order = rng.permutation(len(x))
    for b in range(batches_per_epoch):
        idx_b = order[b * BATCH:(b + 1) * BATCH]
        params, value = step(params, x[idx_b], y[idx_b])
jax.block_until_ready(params)
seconds = time.perf_counter() - start
samples = EPOCHS * batches_per_epoch * BATCH
print(json.dumps({"jax_version": jax.__version__, "mlp_train_samples_per_s": samples / seconds,
                  "final_batch_loss": float(value)}))

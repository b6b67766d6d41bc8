"""JAX/XLA (and NumPy/OpenBLAS) baselines for `canopy model bench`'s workloads.

Each workload is the one `canopy model bench` times, on the same data and
the same cores, with start-up (data loading, compilation) left out:

  mlp     MLP 784-128-10, 5 epochs over the mnist-10k train split, shuffled,
          batch 64 (short final batch dropped), SGD lr 0.1, a jit-compiled step.
  lenet5  LeNet-5 (conv 5x5 pad 2 -> ReLU -> max pool 2, conv 5x5 -> ReLU ->
          max pool 2, 400-120-84-10 with ReLU), 1 epoch, batch 64, SGD lr 0.1.
  charlm  an embedding of 8 over 77 characters, one GRU of 256 (PyTorch's
          equations, the input's projection one matmul before the loop),
          sequence 80, a linear map of the last state over the vocabulary,
          batch 32, SGD lr 0.1; the recurrence is `lax.scan`. Timed over a
          fixed number of steps on random characters (speed does not depend
          on the text).
  matmul  f32 n x n products through NumPy (OpenBLAS), n = 256, 512, 1024.

Inputs are standardised inside the timed step, as Canopy's models do.
Prints one JSON object.

    pip install "jax[cpu]" numpy && python3 bench/jax_baselines.py [datasets/mnist-10k]
"""
import gzip, json, pathlib, sys, time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

DATA = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "datasets/mnist-10k")
BATCH, LR = 64, 0.1
CHARLM = dict(vocabulary=77, embedding=8, hidden=256, sequence=80, batch=32, steps=60)


def idx(path, header):
    return np.frombuffer(gzip.open(path).read(), dtype=np.uint8, offset=header)


X = idx(DATA / "train-images-idx3-ubyte.gz", 16).reshape(-1, 784).astype(np.float32) / 255.0
Y = idx(DATA / "train-labels-idx1-ubyte.gz", 8).astype(np.int32)
MEAN, STD = X.mean(0), X.std(0) + 1e-6


def uniform(key, shape, fan_in):
    bound = 1 / np.sqrt(fan_in)
    return jax.random.uniform(key, shape, minval=-bound, maxval=bound)


def cross_entropy(logits, labels):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))


def sgd_step(loss):
    @jax.jit
    def step(p, xb, yb):
        value, grads = jax.value_and_grad(loss)(p, xb, yb)
        return jax.tree_util.tree_map(lambda w, g: w - LR * g, p, grads), value
    return step


def mlp_params(key):
    k1, k2 = jax.random.split(key)
    return [uniform(k1, (784, 128), 784), jnp.zeros(128), uniform(k2, (128, 10), 128), jnp.zeros(10)]


def mlp_loss(p, xb, yb):
    xb = (xb - MEAN) / STD
    h = jax.nn.relu(xb @ p[0] + p[1])
    return cross_entropy(h @ p[2] + p[3], yb)


def lenet_params(key):
    k = jax.random.split(key, 5)
    return {
        "c1": (uniform(k[0], (6, 1, 5, 5), 25), jnp.zeros(6)),
        "c2": (uniform(k[1], (16, 6, 5, 5), 150), jnp.zeros(16)),
        "f1": (uniform(k[2], (400, 120), 400), jnp.zeros(120)),
        "f2": (uniform(k[3], (120, 84), 120), jnp.zeros(84)),
        "f3": (uniform(k[4], (84, 10), 84), jnp.zeros(10)),
    }


def conv_relu_pool(x, w, b, pad):
    y = lax.conv_general_dilated(x, w, (1, 1), [(pad, pad), (pad, pad)],
                                 dimension_numbers=("NCHW", "OIHW", "NCHW"))
    y = jax.nn.relu(y + b[None, :, None, None])
    return lax.reduce_window(y, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")


def lenet_loss(p, xb, yb):
    x = ((xb - MEAN) / STD).reshape(-1, 1, 28, 28)
    x = conv_relu_pool(x, *p["c1"], 2)
    x = conv_relu_pool(x, *p["c2"], 0).reshape(x.shape[0], -1)
    x = jax.nn.relu(x @ p["f1"][0] + p["f1"][1])
    x = jax.nn.relu(x @ p["f2"][0] + p["f2"][1])
    return cross_entropy(x @ p["f3"][0] + p["f3"][1], yb)


def epochs_rate(loss, params, epochs):
    step = sgd_step(loss)
    rng = np.random.default_rng(0)
    per_epoch = len(X) // BATCH
    jax.block_until_ready(step(params, X[:BATCH], Y[:BATCH]))  # compile
    start = time.perf_counter()
    for _ in range(epochs):
        order = rng.permutation(len(X))
        for b in range(per_epoch):
            i = order[b * BATCH:(b + 1) * BATCH]
            params, value = step(params, X[i], Y[i])
    jax.block_until_ready(params)
    return epochs * per_epoch * BATCH / (time.perf_counter() - start), float(value)


def charlm_params(key, vocabulary, embedding, hidden, **_):
    k = jax.random.split(key, 4)
    return {
        "embed": jax.random.normal(k[0], (vocabulary, embedding)),
        "w_ih": uniform(k[1], (embedding, 3 * hidden), hidden),
        "w_hh": uniform(k[2], (hidden, 3 * hidden), hidden),
        "b_ih": jnp.zeros(3 * hidden),
        "b_hh": jnp.zeros(3 * hidden),
        "out": (uniform(k[3], (hidden, vocabulary), hidden), jnp.zeros(vocabulary)),
    }


def charlm_loss(p, xb, yb):
    hidden = p["w_hh"].shape[0]
    projected = jnp.swapaxes(p["embed"][xb] @ p["w_ih"] + p["b_ih"], 0, 1)  # [T, B, 3H]

    def cell(h, gx):
        gh = h @ p["w_hh"] + p["b_hh"]
        r = jax.nn.sigmoid(gx[:, :hidden] + gh[:, :hidden])
        z = jax.nn.sigmoid(gx[:, hidden:2 * hidden] + gh[:, hidden:2 * hidden])
        n = jnp.tanh(gx[:, 2 * hidden:] + r * gh[:, 2 * hidden:])
        return (1 - z) * n + z * h, None

    h0 = jnp.zeros((xb.shape[0], hidden))
    last, _ = lax.scan(cell, h0, projected)
    return cross_entropy(last @ p["out"][0] + p["out"][1], yb)


def charlm_rate(params, vocabulary, sequence, batch, steps, **_):
    step = sgd_step(charlm_loss)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, vocabulary, (batch, sequence), dtype=np.int32),
                rng.integers(0, vocabulary, batch, dtype=np.int32)) for _ in range(steps)]
    jax.block_until_ready(step(params, *batches[0]))  # compile
    start = time.perf_counter()
    for xb, yb in batches:
        params, value = step(params, xb, yb)
    jax.block_until_ready(params)
    return steps * batch / (time.perf_counter() - start), float(value)


def matmul_gflops(n, seconds=0.6):
    rng = np.random.default_rng(0)
    a, b = rng.random((n, n), dtype=np.float32), rng.random((n, n), dtype=np.float32)
    a @ b
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        reps += 1
    return 2 * n ** 3 * reps / (time.perf_counter() - start) / 1e9


key = jax.random.PRNGKey(0)
mlp_rate, mlp_loss_value = epochs_rate(mlp_loss, mlp_params(key), 5)
lenet_rate, lenet_loss_value = epochs_rate(lenet_loss, lenet_params(key), 1)
charlm_samples, charlm_loss_value = charlm_rate(charlm_params(key, **CHARLM), **CHARLM)
print(json.dumps({
    "jax_version": jax.__version__,
    "numpy_version": np.__version__,
    "mlp_train_samples_per_s": mlp_rate,
    "lenet5_train_samples_per_s": lenet_rate,
    "charlm_train_samples_per_s": charlm_samples,
    "matmul_gflops": {str(n): matmul_gflops(n) for n in (256, 512, 1024)},
    "final_batch_loss": {"mlp": mlp_loss_value, "lenet5": lenet_loss_value, "charlm": charlm_loss_value},
}))

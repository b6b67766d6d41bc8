"""Float64 references for engine/tests/gelu_jax.rs, computed with JAX.

Reads a JSON list of cases on stdin; each has a `kind` (one of the
compositions below), the f32 inputs `x`, `w`, `c` and the tangents `tx`,
`tw` as flat lists with their shapes. Writes, per case, the value, the
gradient with respect to (x, w), the JVP along (tx, tw), and the
Hessian-vector product H·(tx, tw) (forward over reverse), all in float64.

The compositions must match `composition` in gelu_jax.rs.
"""

import json
import sys

import jax

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402


def gelu(v):
    return jax.nn.gelu(v, approximate=False)


def composition(kind, c):
    if kind == "matmul_gelu_sum":
        return lambda x, w: jnp.sum(gelu(x @ w) * c)
    if kind == "gelu_matmul_softmax":
        return lambda x, w: jnp.sum(jax.nn.softmax(gelu(x) @ w, axis=1) * c)
    if kind == "matmul_gelu_max_mean":
        return lambda x, w: jnp.mean(jnp.max(gelu(x @ w), axis=1)) + jnp.mean(gelu(w))
    if kind == "nested_gelu_log_softmax":
        return lambda x, w: jnp.sum(jax.nn.log_softmax(gelu(gelu(x) @ w), axis=1) * c)
    raise ValueError(f"unknown composition {kind!r}")


def array(case, name):
    return jnp.asarray(case[name], dtype=jnp.float64).reshape(case[name + "_shape"])


def reference(case):
    x, w, c = array(case, "x"), array(case, "w"), array(case, "c")
    tx, tw = array(case, "tx"), array(case, "tw")
    f = composition(case["kind"], c)
    value, (gx, gw) = jax.value_and_grad(f, argnums=(0, 1))(x, w)
    _, jvp = jax.jvp(f, (x, w), (tx, tw))
    gradient = jax.grad(f, argnums=(0, 1))
    _, (hx, hw) = jax.jvp(gradient, (x, w), (tx, tw))
    flat = lambda a: [float(v) for v in jnp.ravel(a)]
    return {
        "value": float(value),
        "grad_x": flat(gx),
        "grad_w": flat(gw),
        "jvp": float(jvp),
        "hvp_x": flat(hx),
        "hvp_w": flat(hw),
    }


json.dump([reference(case) for case in json.load(sys.stdin)], sys.stdout)

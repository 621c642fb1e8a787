"""One projection's training matmuls on one accelerator: bf16 against kdist's int8 matmul and
a candidate that reuses the forward pass's codes in the backward pass.

A layer's training step runs three products per projection: the forward ``y = x·w``, the
input gradient ``dx = dy·wᵀ`` and the weight gradient ``dw = xᵀ·dy``. Each side below is
one jitted function ``(x, w, dy) -> (y, dx, dw)`` at a projection shape of gpt2-medium's
step (batch 8 x 1024 tokens, ``mixed_bfloat16``: x and dy bf16, w float32 cast to bf16 as
Keras does):

* ``bf16``: ``jax.vjp`` of ``x @ w`` in bf16 (what the model runs under ``"bf16"``);
* ``int8 (kdist)``: :func:`kdist.precision.matmul.int8_matmul`, which quantizes both
  operands of each of the three products afresh (x and w twice each per step, dy twice);
* ``int8, forward codes reused``: the forward quantizes x per token and w per output
  channel and keeps the int8 codes (not x and w) for the backward pass, which folds the
  other operand's scale into dy before quantizing it: ``dx = Q(dy·s_w)·c_wᵀ`` (dy per
  token) and ``dw = c_xᵀ·Q(s_x·dy)`` (dy per output channel) — the straight-through
  gradient at the dequantized operands, with two quantizations of dy-sized arrays per step
  instead of six of x, w and dy (AQT's ``use_fwd_quant``).

Each row: milliseconds per call (median of ``--repeats`` timed calls after two warm-up
ones), TFLOP/s of the three products (6·M·K·N per call), the speed-up over bf16 at the same
shape, and the relative error of y, dx and dw against a float32 reference.

    python benchmarks/int8_matmul.py             # one TPU v5e chip: ~1 minute
    python benchmarks/int8_matmul.py --dry-run   # tiny shapes on any device (CI)
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import print_table, write_result  # noqa: E402

# name -> (x shape, w shape, contracted axes): gpt2-medium at batch 8, T 1024.
SHAPES = {
    "query (btd,dnh->btnh)": ((8, 1024, 1024), (1024, 16, 64), 1),
    "attention out (btnh,nhd->btd)": ((8, 1024, 16, 64), (16, 64, 1024), 2),
    "mlp up (btd,df->btf)": ((8, 1024, 1024), (1024, 4096), 1),
    "mlp down (btf,fd->btd)": ((8, 1024, 4096), (4096, 1024), 1),
    "vocabulary head (btd,dv->btv)": ((8, 1024, 1024), (1024, 50304), 1),
}
DRY_SHAPES = {"mlp up (btd,df->btf)": ((2, 16, 32), (32, 64), 1),
              "query (btd,dnh->btnh)": ((2, 16, 32), (32, 4, 8), 1)}


def _bf16(x, w, dy, contracted):
    import jax

    y, vjp = jax.vjp(lambda x, w: _dot(x, w.astype(x.dtype), contracted), x, w)
    return (y, *vjp(dy))


def _dot(a, b, contracted):
    from jax import lax
    lead = a.ndim - contracted
    return lax.dot_general(a, b, ((tuple(range(lead, a.ndim)), tuple(range(contracted))),
                                  ((), ())))


def _kdist_int8(x, w, dy, contracted):
    import jax

    from kdist.precision.matmul import int8_matmul
    y, vjp = jax.vjp(lambda x, w: int8_matmul(x, w.astype(x.dtype), contracted), x, w)
    return (y, *vjp(dy))


def _reused_codes_matmul():
    """The candidate: ``matmul(x, w, contracted)``, a custom VJP whose residuals are the
    forward's codes and scales."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from kdist.precision import quantize

    def codes_product(ca, cb, contract_a, contract_b, kept_a=None, kept_b=None):
        """``ca·cb`` accumulated in int32, times the scales of the axes each keeps (None: 1)."""
        acc = lax.dot_general(ca, cb, ((contract_a, contract_b), ((), ())),
                              preferred_element_type=jnp.int32).astype(jnp.float32)
        n_b = cb.ndim - len(contract_b)
        if kept_a is not None:
            acc = acc * kept_a.reshape(kept_a.shape + (1,) * n_b)
        return acc if kept_b is None else acc * kept_b

    @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
    def matmul(x, w, contracted):
        return forward(x, w, contracted)[0]

    def forward(x, w, contracted):
        lead = x.ndim - contracted
        k_x, k_w = tuple(range(lead, x.ndim)), tuple(range(contracted))
        cx, sx = quantize.int8(x, axis=k_x)  # per token
        cw, sw = quantize.int8(w, axis=k_w)  # per output channel
        y = codes_product(cx, cw, k_x, k_w, jnp.squeeze(sx, k_x), jnp.squeeze(sw, k_w))
        return y.astype(x.dtype), (cx, jnp.squeeze(sx, k_x), cw, jnp.squeeze(sw, k_w))

    def backward(contracted, saved, dy):
        cx, sx, cw, sw = saved
        lead = cx.ndim - contracted
        tokens, outputs = tuple(range(lead)), tuple(range(lead, dy.ndim))
        # dx = (dy · s_w) · c_wᵀ, dy·s_w quantized per token (over the outputs).
        cd, sd = quantize.int8(dy.astype(jnp.float32) * sw, axis=outputs)
        dx = codes_product(cd, cw, outputs, tuple(range(contracted, cw.ndim)),
                           jnp.squeeze(sd, outputs))
        # dw = c_xᵀ · (s_x · dy), s_x·dy quantized per output channel (over the tokens).
        scaled = dy.astype(jnp.float32) * sx.reshape(sx.shape + (1,) * (dy.ndim - lead))
        ce, se = quantize.int8(scaled, axis=tokens)
        dw = codes_product(cx, ce, tokens, tokens, None, jnp.squeeze(se, tokens))
        return dx.astype(dy.dtype), dw.astype(dy.dtype)

    matmul.defvjp(forward, backward)
    return matmul


def _reused_codes():
    import jax
    matmul = _reused_codes_matmul()

    def side(x, w, dy, contracted):
        y, vjp = jax.vjp(lambda x, w: matmul(x, w.astype(x.dtype), contracted), x, w)
        return (y, *vjp(dy))
    return side


def _reference(x, w, dy, contracted):
    import jax
    import jax.numpy as jnp
    with jax.default_matmul_precision("highest"):
        y, vjp = jax.vjp(lambda x, w: _dot(x, w, contracted), x.astype(jnp.float32), w)
        return (y, *vjp(dy.astype(jnp.float32)))


def measure(shapes: dict, repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    sides = {"bf16": _bf16, "int8 (kdist)": _kdist_int8,
             "int8, forward codes reused": _reused_codes()}
    rows = []
    for name, (x_shape, w_shape, contracted) in shapes.items():
        keys = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(keys[0], x_shape, jnp.bfloat16)
        w = jax.random.normal(keys[1], w_shape, jnp.float32) * 0.02
        y_shape = x_shape[:len(x_shape) - contracted] + w_shape[contracted:]
        dy = (jax.random.normal(keys[2], y_shape, jnp.float32) * 1e-3).astype(jnp.bfloat16)
        reference = jax.jit(_reference, static_argnums=3)(x, w, dy, contracted)
        flops = 6 * np.prod(x_shape) * np.prod(w_shape[contracted:])
        base = None
        for side, fn in sides.items():
            step = jax.jit(fn, static_argnums=3)
            jax.block_until_ready(step(x, w, dy, contracted))  # compile
            jax.block_until_ready(step(x, w, dy, contracted))
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                out = jax.block_until_ready(step(x, w, dy, contracted))
                times.append(time.perf_counter() - start)
            ms = 1e3 * statistics.median(times)
            errors = [float(jnp.linalg.norm(a.astype(jnp.float32) - r) / jnp.linalg.norm(r))
                      for a, r in zip(out, reference)]
            base = base or ms
            rows.append({"shape": name, "side": side, "ms": ms, "tflops": float(flops / ms / 1e9),
                         "speedup": base / ms, "error_y": errors[0], "error_dx": errors[1],
                         "error_dw": errors[2]})
            print(rows[-1], flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on any device (CI)")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    import jax
    rows = measure(DRY_SHAPES if args.dry_run else SHAPES, 2 if args.dry_run else args.repeats)
    print_table("int8 matmuls, one projection's forward and backward products", rows, [
        ("shape", "shape", ""), ("side", "side", ""), ("ms", "ms", ".3f"),
        ("TFLOP/s", "tflops", ".1f"), ("x bf16", "speedup", ".2f"),
        ("err y", "error_y", ".1e"), ("err dx", "error_dx", ".1e"), ("err dw", "error_dw", ".1e")])
    write_result("int8_matmul_dry_run" if args.dry_run else "int8_matmul",
                 {"args": vars(args), "device": jax.devices()[0].device_kind, "rows": rows})
    return rows


if __name__ == "__main__":
    main()

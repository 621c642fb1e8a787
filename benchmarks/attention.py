"""Attention implementations side by side on one device: forward + backward time of each at
the shapes kdist trains, in one run — the measurements behind ``kdist.accelerators``.

For each shape ``(B, T, N, K, H)`` (batch, length, query heads, key/value heads, head size)
and each implementation — XLA's (``keras.ops.dot_product_attention``), kdist's chunked
online softmax (``kdist.models.chunked_attention.chunked_attention``) at several chunk sizes,
Pallas splash attention through kdist's wrapper (``kdist.kernels.splash``) at several tile
sizes, kdist's own Pallas kernels (``kdist.kernels.flash``) at several tile sizes, and
JAX's older Pallas ``flash_attention`` kernel — it times a jitted gradient of
``sum(attention(q, k, v) * g)`` with respect to ``q, k, v`` (one forward and one backward
pass), causal, bfloat16 inputs, after a warm-up, and reports the median milliseconds, the
ratio to XLA's row of the same shape, the attained TFLOP/s counting causal attention as
half of ``T x S`` (forward ``4 B N T S H``, backward twice that), and the largest
difference from XLA's output. ``--dry-run``: tiny shapes on any device (the Pallas kernels
interpreted on a CPU), for CI.

    python benchmarks/attention.py              # on a TPU (or GPU; splash rows need a TPU)
    python benchmarks/attention.py --dry-run    # CPU: checks the plumbing
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import print_table, write_result  # noqa: E402

# (name, B, T, N, K, H): gpt2-small and gpt2-medium at T = 1024 (batches the chip trains
# them at), and a Llama-style grouped-query shape at T = 2048.
SHAPES = [
    ("gpt2-small b16", 16, 1024, 12, 12, 64),
    ("gpt2-medium b8", 8, 1024, 16, 16, 64),
    ("llama-style b4", 4, 2048, 12, 4, 128),
]
DRY_SHAPES = [("tiny", 2, 256, 4, 2, 64)]
# Splash tiles: (queries, keys) forward = backward, fused backward kernel or not.
SPLASH = [(128, 128, False), (256, 256, True), (512, 512, True), (512, 512, False),
          (1024, 512, True), (512, 1024, True), (1024, 1024, True)]
DRY_SPLASH = [(128, 128, False), (128, 256, True)]
# kdist's flash tiles: (queries, key chunk) forward, (query chunk, keys) backward.
FLASH = [(512, 512, 512, 512), (1024, 512, 512, 512), (1024, 1024, 512, 512),
         (512, 512, 1024, 512), (512, 512, 512, 1024), (256, 512, 512, 512),
         (512, 256, 256, 512)]
DRY_FLASH = [(128, 128, 128, 256)]
CHUNKS = (128, 256, 512)


def implementations(dry_run: bool, platform: str, only=None):
    """``(name, options, fn(q, k, v) -> out)`` of every implementation to time."""
    import jax.numpy as jnp
    from keras import ops

    from kdist.kernels import splash
    from kdist.models.chunked_attention import chunked_attention

    out = [("xla", {}, lambda q, k, v: ops.dot_product_attention(q, k, v, is_causal=True))]
    for c in CHUNKS[:1] if dry_run else CHUNKS:
        out.append(("chunked", {"chunk": c},
                    lambda q, k, v, c=c: chunked_attention(q, k, v, is_causal=True,
                                                           chunk_size=c)))
    interpret = platform != "tpu"
    for bq, bkv, fused in DRY_SPLASH if dry_run else SPLASH:
        blocks = splash.Blocks(bq, bkv, fused=fused)
        out.append(("splash", {"block_q": bq, "block_kv": bkv, "fused_bwd": fused},
                    lambda q, k, v, b=blocks: splash.splash_attention(
                        q, k, v, causal=True, blocks=b, interpret=interpret)))
    from kdist.kernels import flash

    for blocks in DRY_FLASH if dry_run else FLASH:
        tiles = flash.FlashBlocks(*blocks)
        out.append(("flash", dict(zip(("block_q", "block_kv", "q_bwd", "kv_bwd"), blocks)),
                    lambda q, k, v, b=tiles: flash.flash_attention(
                        q, k, v, causal=True, blocks=b, interpret=interpret)))
    if platform == "tpu":  # JAX's older Pallas kernel: no grouped-query heads, no interpreter
        from jax.experimental.pallas.ops.tpu import flash_attention as fa

        def pallas_flash(q, k, v, block=512):
            groups = q.shape[2] // k.shape[2]
            q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, jnp.repeat(k, groups, 2),
                                                        jnp.repeat(v, groups, 2)))
            b = min(block, q.shape[2])
            sizes = fa.BlockSizes(block_q=b, block_k_major=b, block_k=b, block_b=1,
                                  block_q_major_dkv=b, block_k_major_dkv=b, block_k_dkv=b,
                                  block_q_dkv=b, block_k_major_dq=b, block_k_dq=b,
                                  block_q_dq=b)
            o = fa.flash_attention(q, k, v, causal=True, sm_scale=q.shape[-1] ** -0.5,
                                   block_sizes=sizes)
            return jnp.swapaxes(o, 1, 2)

        out.append(("pallas flash", {"block": 512}, pallas_flash))
    return [row for row in out if only is None or row[0] in only]


def time_one(fn, q, k, v, g, iterations: int) -> tuple[float, object]:
    """Median seconds of one forward + backward of ``fn``, and its forward output."""
    import jax
    import jax.numpy as jnp

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * g)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(step(q, k, v))  # compile and warm up
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        jax.block_until_ready(step(q, k, v))
        times.append(time.perf_counter() - start)
    return statistics.median(times), jax.jit(fn)(q, k, v)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes, any device (CI)")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--output", default="attention", help="result name under results/")
    p.add_argument("--implementations", nargs="*", default=None,
                   help="only these (xla, chunked, splash, flash, 'pallas flash'); XLA's row "
                        "is the reference and always runs")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    device = jax.devices()[0]
    rng = np.random.default_rng(0)
    rows = []
    for name, b, t, n, kh, h in DRY_SHAPES if args.dry_run else SHAPES:
        dtype = jnp.float32 if args.dry_run else jnp.bfloat16
        q = jnp.asarray(rng.normal(size=(b, t, n, h)), dtype)
        k, v = (jnp.asarray(rng.normal(size=(b, t, kh, h)), dtype) for _ in range(2))
        g = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
        flops = 12 * b * n * t * t * h * 0.5  # forward 4BNTSH + backward 8BNTSH, causal half
        reference = None
        only = None if args.implementations is None else {"xla", *args.implementations}
        for impl, options, fn in implementations(args.dry_run, device.platform, only):
            try:
                seconds, out = time_one(fn, q, k, v, g, 2 if args.dry_run else args.iterations)
            except Exception as error:  # noqa: BLE001 - a kernel that cannot run is a row
                rows.append({"shape": name, "implementation": impl, **options,
                             "error": f"{type(error).__name__}: {str(error)[:200]}"})
                print(f"{name} {impl} {options}: {rows[-1]['error']}", flush=True)
                continue
            if reference is None:
                reference = (seconds, out)
            diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) -
                                         reference[1].astype(jnp.float32))))
            rows.append({"shape": name, "B": b, "T": t, "N": n, "K": kh, "H": h,
                         "implementation": impl, **options, "ms": seconds * 1e3,
                         "vs_xla": seconds / reference[0], "tflops": flops / seconds / 1e12,
                         "max_diff_vs_xla": diff})
            print(f"{name} {impl} {options}: {seconds * 1e3:.2f} ms "
                  f"({seconds / reference[0]:.2f}x XLA), diff {diff:.3g}", flush=True)
    print_table(f"{'DRY RUN — ' if args.dry_run else ''}attention forward + backward, causal, "
                f"{device.device_kind}", [r for r in rows if "ms" in r],
                [("shape", "shape", ""), ("impl", "implementation", ""),
                 ("chunk", "chunk", "d"), ("bq", "block_q", "d"), ("bkv", "block_kv", "d"),
                 ("fused", "fused_bwd", ""), ("bq bwd", "q_bwd", "d"), ("bkv bwd", "kv_bwd", "d"),
                 ("ms", "ms", ".2f"), ("vs XLA", "vs_xla", ".2f"),
                 ("TFLOP/s", "tflops", ".1f"), ("max diff", "max_diff_vs_xla", ".2g")])
    write_result(f"{args.output}_dry_run" if args.dry_run else args.output,
                 {"args": vars(args), "device_kind": device.device_kind, "rows": rows})
    return rows


if __name__ == "__main__":
    main()

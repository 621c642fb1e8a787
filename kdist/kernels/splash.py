"""Splash attention (Pallas, ``jax.experimental.pallas.ops.tpu.splash_attention``) in kdist's
``(B, T, N, H)`` layout: causal or bidirectional, documents kept apart by segment ids,
grouped-query heads.

Splash is the TPU's flash attention: the ``(T, S)`` logits live one ``(block_q, block_kv)``
tile at a time in VMEM, tiles wholly in the future are skipped (causal attention costs
half), and the backward pass recomputes them from the forward's output and log-sum-exp. On
a TPU it compiles to Mosaic kernels; anywhere else Pallas *interprets* the same kernels
with ordinary JAX operations (exact and slow: how the CPU tests check the code the chip
runs). Block sizes are :class:`Blocks`, chosen by measurement in :mod:`kdist.accelerators`.

The kernel computes ``softmax(q k^T) v`` unscaled, so queries are scaled by ``1/sqrt(H)``
first, in their dtype (exact for a power of two such as ``H = 64``). Under a kdist
distribution it runs per device, in a ``shard_map`` over the batch's replica axes and the
``model`` axis's heads: a Pallas call is opaque to XLA's partitioner, which would
otherwise gather its operands onto every device. Inside a region of kdist's where axes are
manual already (the explicit gradient reduction, a pipeline stage, a replica group) it
cannot run — JAX 0.10's Pallas calls do not type their outputs for ``shard_map``'s checks
of what varies between devices — and ``"auto"`` attends by chunks there instead.

Example:
    >>> q = jnp.ones((1, 128, 2, 64)); kv = jnp.ones((1, 128, 1, 64))
    >>> splash_attention(q, kv, kv, causal=True).shape  # interpreted on a CPU
    (1, 128, 2, 64)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

# The kernels tile both sequences in multiples of the TPU's 128 lanes.
LANES = 128
# The checkpoint name of the output and log-sum-exp the backward pass needs: a
# rematerialisation policy that saves it (kdist.models.remat's "minimal") keeps them
# instead of running the forward kernel again.
RESIDUALS = "attention"


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Splash's tile sizes: queries and keys per tile in the forward pass (``q``, ``kv``)
    and in the backward pass (``q_dkv``, ``kv_dkv``); ``fused``: one backward kernel for
    dq, dk and dv (else a dq kernel beside the dk/dv one). Each is clipped to the sequence
    length, and must be a multiple of :data:`LANES`.

    Example:
        >>> Blocks(512, 512).for_lengths(1024, 256).block_kv
        256
    """

    q: int = 512
    kv: int = 512
    q_dkv: int | None = None  # None: as in the forward pass
    kv_dkv: int | None = None
    fused: bool = True

    def for_lengths(self, queries: int, keys: int):
        """Splash's ``BlockSizes`` for ``queries`` x ``keys`` attention."""
        from jax.experimental.pallas.ops.tpu import splash_attention as sa

        bq, bkv = min(self.q, queries), min(self.kv, keys)
        bq_dkv, bkv_dkv = min(self.q_dkv or self.q, queries), min(self.kv_dkv or self.kv, keys)
        dq = {} if self.fused else dict(block_q_dq=bq_dkv, block_kv_dq=bkv_dkv)
        return sa.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv,
                             block_q_dkv=bq_dkv, block_kv_dkv=bkv_dkv,
                             block_kv_dkv_compute=bkv_dkv, use_fused_bwd_kernel=self.fused,
                             **dq)


def supports(queries: int, keys: int, head_dim: int) -> bool:
    """Whether splash can attend ``queries`` over ``keys`` at this head size: both lengths
    in whole tiles of 128 (shorter or ragged sequences go to another implementation).

    Example:
        >>> supports(1024, 1024, 64), supports(1000, 1000, 64)
        (True, False)
    """
    return queries % LANES == 0 and keys % LANES == 0 and head_dim % 8 == 0


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, queries: int, keys: int, causal: bool, blocks: Blocks,
            interpret: bool):
    """A splash kernel for one example's ``(heads, queries, H)`` (cached: building its
    block masks is numpy work at trace time)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    one = sa.CausalMask((queries, keys)) if causal else sa.FullMask((queries, keys))
    with jax.ensure_compile_time_eval():  # its mask tables: constants, not this trace's
        return sa.make_splash_mha(sa.MultiHeadMask([one] * heads),
                                  block_sizes=blocks.for_lengths(queries, keys),
                                  head_shards=1, q_seq_shards=1,
                                  residual_checkpoint_name=RESIDUALS, interpret=interpret)


def _local(q, k, v, segment_ids, *, causal, blocks, interpret):
    """One device's attention: ``q (B, T, N, H)``, ``k``/``v (B, S, K, H)``."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    heads, queries, keys = q.shape[2], q.shape[1], k.shape[1]
    kernel = _kernel(heads, queries, keys, causal, blocks, interpret)
    scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q * jnp.asarray(scale, q.dtype), k, v))
    if segment_ids is None:
        out = jax.vmap(kernel)(q, k, v)  # (B, N, T, H)
    else:
        ids = segment_ids.astype(jnp.int32)
        out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=sa.SegmentIds(s, s)))(
            q, k, v, ids)
    return jnp.swapaxes(out, 1, 2)  # (B, T, N, H)


def splash_attention(q, k, v, *, causal: bool, segment_ids=None, blocks: Blocks | None = None,
                     interpret: bool | None = None):
    """``softmax(q k^T / sqrt(H)) v`` of ``q (B, T, N, H)`` over ``k``/``v (B, S, K, H)``
    (``N % K == 0``), by Pallas splash kernels.

    Args:
        causal: query ``t`` sees keys ``0..t``.
        segment_ids: optional ``(B, T)`` document ids (self-attention, ``S == T``): a query
            sees only its own document's keys.
        blocks: tile sizes (default :class:`Blocks`'s).
        interpret: run the kernels in Pallas' interpreter; default: unless JAX's default
            backend is a TPU (a caller compiling for another device than JAX's default
            says which: ``kdist.accelerators.target``).

    Returns ``(B, T, N, H)`` in the query's dtype.
    """
    from kdist.kernels.sharding import per_device

    if not supports(q.shape[1], k.shape[1], q.shape[-1]):
        raise ValueError(f"Splash attention tiles sequences in multiples of {LANES} tokens; "
                         f"got {q.shape[1]} queries over {k.shape[1]} keys. Use "
                         f"attention_implementation='xla' or 'chunked' for this length.")
    if segment_ids is not None and k.shape[1] != q.shape[1]:
        raise ValueError("segment_ids are those of self-attention: keys and queries must be "
                         f"the same tokens; got {q.shape[1]} queries over {k.shape[1]} keys.")
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    local = functools.partial(_local, causal=causal, blocks=blocks or Blocks(),
                              interpret=interpret)
    return per_device(local, q, k, v, segment_ids, name="Splash attention")

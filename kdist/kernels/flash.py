"""kdist's own flash attention for TPUs (Pallas): causal or bidirectional, documents kept
apart by segment ids, grouped-query heads; each example's keys and values whole in VMEM.

Written where splash (:mod:`kdist.kernels.splash`) falls short on the TPU v5e: at 64-wide
heads (GPT-2's) its tiles cost as much per logit as at 128-wide ones, a causal tile on the
diagonal is computed whole and masked, and its forward kernel multiplies probabilities by
values in float32. Here:

- the forward pass walks one ``(H, block_q)`` tile of queries over key chunks of
  ``block_kv``, in two loops whose bounds are computed from the tile's position: chunks
  wholly in the past without a mask, chunks crossing the diagonal with it, chunks in the
  future not at all;
- it computes the logits as keys x queries, ``k q^T``: the softmax's running maximum and
  sum reduce over sublanes (cheap) rather than across lanes, and its statistics are rows,
  stored as they are (splash keeps 128 lane copies of each); measured, this orientation
  took 0.81x the time of queries x keys at gpt2-medium's shape;
- every head goes in and out as ``(H, T)``, the sequence in lanes: the layout in which
  the TPU's matmuls produce the query/key/value projections and take their gradients back,
  so XLA materialises no transpose around the kernels. Heads as ``(T, H)`` cost
  gpt2-medium (64-wide heads) 4.5 ms of copies per 173 ms step and slowed the projections'
  matmuls, whose 64-wide outputs filled half of each 128-lane row: the ``(H, T)`` kernels
  took the step to 153 ms (measured, ``benchmarks/README.md``). Inside, a key chunk is
  transposed on the XLU where a matmul needs it as rows;
- both matmuls take bfloat16 operands (float32 accumulation), the softmax statistics
  float32; queries are scaled by ``1/sqrt(H)`` in float32 and rounded once, in the kernels;
- one backward kernel per ``(key/value head, key block)`` makes dk^T, dv^T and dq^T: it
  walks the query chunks that see the block (the transposed logits ``k q^T``, so the
  forward's log-sum-exp and ``rowsum(dO * O)`` broadcast as rows), keeps dk^T/dv^T in
  registers and adds dq^T into a VMEM accumulator; its matmuls take their operands as
  stored or with both contracting over lanes (the block's keys and values are transposed
  once).

The kernel takes an example's keys and values (and its queries, in the backward pass)
whole: :func:`supports` bounds them so that they fit in VMEM beside the tiles; longer
sequences go to splash. Off a TPU, Pallas interprets the same kernels (exact, slow: the CPU
tests). Under a kdist distribution it runs per device like splash
(:func:`kdist.kernels.sharding.per_device`).

Example:
    >>> q = jnp.ones((1, 256, 2, 64)); kv = jnp.ones((1, 256, 1, 64))
    >>> flash_attention(q, kv, kv, causal=True).shape  # interpreted on a CPU
    (1, 256, 2, 64)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from kdist.kernels.splash import LANES, RESIDUALS

# A logit no query may see: finite, so that a row whose first chunk is wholly masked (a
# later document's query) does not make exp(-inf - -inf); the mass it adds is wiped when
# the row's first visible key raises its maximum (alpha = exp(MASKED - max) = 0).
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
# What one example's whole queries, keys and values (with their gradients, double-buffered)
# may take of a TPU core's VMEM: elements of (heads sharing a key) x length x head size.
MAX_WHOLE = 1 << 20


@dataclasses.dataclass(frozen=True)
class FlashBlocks:
    """Tile sizes: ``q`` queries per forward tile over key chunks of ``kv``; the backward
    pass walks key blocks of ``kv_bwd`` over query chunks of ``q_bwd``. Each is clipped to
    the sequence and must divide it (multiples of :data:`LANES`).

    Example:
        >>> FlashBlocks(512, 256).clipped(256, 256).q
        256
    """

    q: int = 512
    kv: int = 512
    q_bwd: int = 512
    kv_bwd: int = 512

    def clipped(self, queries: int, keys: int) -> FlashBlocks:
        return dataclasses.replace(self, q=min(self.q, queries), kv=min(self.kv, keys),
                                   q_bwd=min(self.q_bwd, queries),
                                   kv_bwd=min(self.kv_bwd, keys))


def supports(queries: int, keys: int, head_dim: int, groups: int = 1,
             blocks: FlashBlocks | None = None) -> bool:
    """Whether the kernel takes these shapes: lengths in whole tiles (each block divides
    its length), a head size of a multiple of 8, and an example's ``groups`` query heads of
    a key/value head small enough to sit whole in VMEM (:data:`MAX_WHOLE`).

    Example:
        >>> supports(1024, 1024, 64), supports(1000, 1000, 64), supports(65536, 65536, 128)
        (True, False, False)
    """
    b = (blocks or FlashBlocks()).clipped(queries, keys)
    tiled = all(n % LANES == 0 and n % blk == 0 for n, blk in
                ((queries, b.q), (keys, b.kv), (queries, b.q_bwd), (keys, b.kv_bwd)))
    return (tiled and head_dim % 8 == 0
            and max(groups * queries, keys) * head_dim <= MAX_WHOLE)


def _mask(s, rows, cols, causal, row_seg, col_seg, *, kv_rows: bool):
    """``s`` with invisible logits set to :data:`MASKED`: ``rows``/``cols`` are the
    positions along each axis; ``kv_rows``: rows are keys (the backward's ``k q^T``)."""
    keep = None
    if causal:
        r = rows + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
        c = cols + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        keep = r <= c if kv_rows else c <= r
    if row_seg is not None:
        same = row_seg == col_seg
        keep = same if keep is None else keep & same
    return s if keep is None else jnp.where(keep, s, MASKED)


def _chunks(i, block, chunk, count, causal, *, past: bool):
    """The chunks of the other axis (``count`` of ``chunk``) a tile at ``i`` (of ``block``)
    walks: ``(masked, plain)``, two ``(start, end)`` ranges, those crossing the diagonal
    and those wholly visible. ``past``: the other axis is keys (the forward pass: keys up to
    the tile's last query); else queries (the backward pass: queries from its first key)."""
    if not causal:
        return (0, 0), (0, count)
    lo, hi = i * block, (i + 1) * block  # this tile's positions [lo, hi)
    crossing_end = jnp.minimum((hi + chunk - 1) // chunk, count)
    if past:  # whole chunks before lo, then those up to hi
        return (lo // chunk, crossing_end), (0, lo // chunk)
    return (lo // chunk, crossing_end), (crossing_end, count)


def _walk(step, masked, plain, segmented, carry):
    """``step(c, carry, masked)`` over both ranges of :func:`_chunks` (every chunk masked
    where documents are: their boundaries fall anywhere)."""
    if segmented:
        start = jnp.minimum(masked[0], plain[0])
        end = jnp.maximum(masked[1], plain[1])
        return jax.lax.fori_loop(start, end, lambda c, x: step(c, x, True), carry)
    carry = jax.lax.fori_loop(*plain, lambda c, x: step(c, x, False), carry)
    return jax.lax.fori_loop(*masked, lambda c, x: step(c, x, True), carry)


def _scaled(x, scale):
    """A tile of queries scaled in float32 and rounded once to the operands' dtype."""
    return (x.astype(jnp.float32) * scale).astype(x.dtype)


def _forward_kernel(*refs, causal, segmented, block_kv, count, scale):
    from jax.experimental import pallas as pl

    if segmented:
        qt_ref, kt_ref, vt_ref, qseg_ref, kseg_ref, ot_ref, lse_ref = refs
    else:
        qt_ref, kt_ref, vt_ref, ot_ref, lse_ref = refs
    i = pl.program_id(2)
    qt = _scaled(qt_ref[...], scale)  # (H, bq)
    head, bq = qt.shape

    def step(c, carry, masked):
        m, total, acc = carry  # running max, sum of exp, output: (1, bq), (1, bq), (H, bq)
        keys = pl.ds(pl.multiple_of(c * block_kv, block_kv), block_kv)
        k = kt_ref[:, keys].T  # (bkv, H): one small transpose on the XLU per chunk
        st = jnp.dot(k, qt, preferred_element_type=jnp.float32)  # (bkv, bq)
        if masked:
            st = _mask(st, c * block_kv, i * bq, causal,
                       kseg_ref[keys, :] if segmented else None,
                       qseg_ref[...] if segmented else None, kv_rows=True)
        m_next = jnp.maximum(m, st.max(axis=0, keepdims=True))
        pt = jnp.exp(st - m_next)
        alpha = jnp.exp(m - m_next)
        total = alpha * total + pt.sum(axis=0, keepdims=True)
        pv = jnp.dot(vt_ref[:, keys], pt.astype(vt_ref.dtype),
                     preferred_element_type=jnp.float32)  # (H, bq)
        return m_next, total, alpha * acc + pv

    carry = (jnp.full((1, bq), MASKED, jnp.float32), jnp.zeros((1, bq), jnp.float32),
             jnp.zeros((head, bq), jnp.float32))
    m, total, acc = _walk(step, *_chunks(i, bq, block_kv, count, causal, past=True), segmented,
                      carry)
    ot_ref[...] = (acc / total).astype(ot_ref.dtype)
    lse_ref[...] = m + jnp.log(total)


def _backward_kernel(*refs, causal, segmented, block_q, count, groups, scale):
    from jax.experimental import pallas as pl

    if segmented:
        (qt_ref, dot_ref, lse_ref, di_ref, kt_ref, vt_ref, qseg_ref, kseg_ref,
         dkt_ref, dvt_ref, dqt_ref, dqt_acc) = refs
    else:
        qt_ref, dot_ref, lse_ref, di_ref, kt_ref, vt_ref, dkt_ref, dvt_ref, dqt_ref, \
            dqt_acc = refs
    j = pl.program_id(2)
    kt = kt_ref[...]  # (H, bkv)
    k, v = kt.T, vt_ref[...].T  # (bkv, H): transposed once per key block
    head, bkv = kt.shape

    @pl.when(j == 0)
    def _():
        dqt_acc[...] = jnp.zeros_like(dqt_acc)

    def step(c, carry, masked, g):
        dkt, dvt = carry  # (H, bkv) each
        queries = pl.ds(pl.multiple_of(c * block_q, block_q), block_q)
        qt = _scaled(qt_ref[g, :, queries], scale)  # (H, bq), as the forward pass scaled it
        dot = dot_ref[g, :, queries]  # (H, bq)
        st = jnp.dot(k, qt, preferred_element_type=jnp.float32)  # (bkv, bq)
        if masked:
            st = _mask(st, j * bkv, c * block_q, causal,
                       kseg_ref[...] if segmented else None,
                       qseg_ref[:, queries] if segmented else None, kv_rows=True)
        pt = jnp.exp(st - lse_ref[g, :, queries])  # (bkv, bq)
        nt = (((1,), (1,)), ((), ()))  # contract the queries of both: (H, bq) x (bkv, bq)
        dvt = dvt + jax.lax.dot_general(dot, pt.astype(dot.dtype), nt,
                                        preferred_element_type=jnp.float32)
        dpt = jnp.dot(v, dot, preferred_element_type=jnp.float32)  # (bkv, bq)
        dst = (pt * (dpt - di_ref[g, :, queries])).astype(qt.dtype)
        dkt = dkt + jax.lax.dot_general(qt, dst, nt, preferred_element_type=jnp.float32)
        dqt_acc[g, :, queries] += jnp.dot(kt, dst, preferred_element_type=jnp.float32)
        return dkt, dvt

    ranges = _chunks(j, bkv, block_q, count, causal, past=False)
    carry = (jnp.zeros((head, bkv), jnp.float32),) * 2
    for g in range(groups):  # the query heads this key/value head serves
        carry = _walk(functools.partial(step, g=g), *ranges, segmented, carry)
    dkt_ref[...] = carry[0].astype(dkt_ref.dtype)
    dvt_ref[...] = carry[1].astype(dvt_ref.dtype)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():  # the gradient of the unscaled queries: scaled once, rounded once
        dqt_ref[...] = (dqt_acc[...] * scale).astype(dqt_ref.dtype)


def _segments(segment_ids):
    """Document ids as a column ``(B, T, 1)`` and a row ``(B, 1, T)``, int32."""
    ids = segment_ids.astype(jnp.int32)
    return ids[:, :, None], ids[:, None, :]


def _forward(qt, kt, vt, segment_ids, causal, blocks, interpret):
    """``qt (B, N, H, T)``, ``kt``/``vt (B, K, H, S)`` -> ``ot (B, N, H, T)`` and the
    log-sum-exp of the scaled logits ``(B, N, 1, T)`` float32."""
    from jax.experimental import pallas as pl

    b, n, h, t = qt.shape
    kh, s = kt.shape[1], kt.shape[3]
    groups = n // kh
    bq, bkv = blocks.q, blocks.kv
    example = lambda b, n, i: (b, n // groups, 0, 0)  # noqa: E731 - its key/value head
    tile = pl.BlockSpec((None, None, h, bq), lambda b, n, i: (b, n, 0, i))
    in_specs = [tile, pl.BlockSpec((None, None, h, s), example),
                pl.BlockSpec((None, None, h, s), example)]
    args = [qt, kt, vt]
    if segment_ids is not None:
        column, row = _segments(segment_ids)
        in_specs += [pl.BlockSpec((None, 1, bq), lambda b, n, i: (b, 0, i)),
                     pl.BlockSpec((None, s, 1), lambda b, n, i: (b, 0, 0))]
        args += [row, column]
    kernel = functools.partial(_forward_kernel, causal=causal,
                               segmented=segment_ids is not None, block_kv=bkv, count=s // bkv,
                               scale=1.0 / math.sqrt(h))
    return pl.pallas_call(
        kernel, grid=(b, n, t // bq), in_specs=in_specs,
        out_specs=[tile, pl.BlockSpec((None, None, 1, bq), lambda b, n, i: (b, n, 0, i))],
        out_shape=[jax.ShapeDtypeStruct((b, n, h, t), qt.dtype),
                   jax.ShapeDtypeStruct((b, n, 1, t), jnp.float32)],
        compiler_params=_params(interpret, ("parallel", "parallel", "parallel")),
        interpret=interpret, name="kdist_flash_forward")(*args)


def _backward(qt, kt, vt, segment_ids, lse, di, dot, causal, blocks, interpret):
    """dq^T, dk^T, dv^T of :func:`_forward`, each in its input's ``(B, heads, H, T)``."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    b, n, h, t = qt.shape
    kh, s = kt.shape[1], kt.shape[3]
    groups = n // kh
    bq, bkv = blocks.q_bwd, blocks.kv_bwd
    segmented = segment_ids is not None
    heads = pl.BlockSpec((None, groups, h, t), lambda b, k, j: (b, k, 0, 0))
    rows = pl.BlockSpec((None, groups, 1, t), lambda b, k, j: (b, k, 0, 0))
    block = pl.BlockSpec((None, None, h, bkv), lambda b, k, j: (b, k, 0, j))
    in_specs = [heads, heads, rows, rows, block, block]
    args = [qt, dot, lse, di, kt, vt]
    if segmented:
        column, row = _segments(segment_ids)
        in_specs += [pl.BlockSpec((None, 1, t), lambda b, k, j: (b, 0, 0)),
                     pl.BlockSpec((None, bkv, 1), lambda b, k, j: (b, j, 0))]
        args += [row, column]
    kernel = functools.partial(_backward_kernel, causal=causal, segmented=segmented,
                               block_q=bq, count=t // bq, groups=groups,
                               scale=1.0 / math.sqrt(h))
    dkt, dvt, dqt = pl.pallas_call(
        kernel, grid=(b, kh, s // bkv), in_specs=in_specs,
        out_specs=[block, block, heads],
        out_shape=[jax.ShapeDtypeStruct(kt.shape, kt.dtype),
                   jax.ShapeDtypeStruct(vt.shape, vt.dtype),
                   jax.ShapeDtypeStruct(qt.shape, qt.dtype)],
        scratch_shapes=[pltpu.VMEM((groups, h, t), jnp.float32)],
        compiler_params=_params(interpret, ("parallel", "parallel", "arbitrary")),
        interpret=interpret, name="kdist_flash_backward")(*args)
    return dqt, dkt, dvt


def _params(interpret, semantics):
    """Mosaic's settings (none when interpreted): which grid axes carry state."""
    if interpret:
        return None
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=semantics)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attend(qt, kt, vt, segment_ids, causal, blocks, interpret):
    """``qt (B, N, H, T)``, ``kt``/``vt (B, K, H, S)`` -> ``ot (B, N, H, T)``."""
    return _forward(qt, kt, vt, segment_ids, causal, blocks, interpret)[0]


def _attend_fwd(qt, kt, vt, segment_ids, causal, blocks, interpret):
    from jax.ad_checkpoint import checkpoint_name

    ot, lse = _forward(qt, kt, vt, segment_ids, causal, blocks, interpret)
    ot, lse = checkpoint_name(ot, RESIDUALS), checkpoint_name(lse, RESIDUALS)
    return ot, (qt, kt, vt, segment_ids, ot, lse)


def _attend_bwd(causal, blocks, interpret, residuals, dot):
    qt, kt, vt, segment_ids, ot, lse = residuals
    # rowsum(dO * O) per query: (B, N, 1, T), a row like the log-sum-exp.
    di = jnp.sum(ot.astype(jnp.float32) * dot.astype(jnp.float32), axis=2, keepdims=True)
    dqt, dkt, dvt = _backward(qt, kt, vt, segment_ids, lse, di, dot.astype(qt.dtype), causal,
                              blocks, interpret)
    return dqt, dkt, dvt, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _local(q, k, v, segment_ids, *, causal, blocks, interpret):
    """One device's attention: ``q (B, T, N, H)``, ``k``/``v (B, S, K, H)``.

    The kernels take and return every head as ``(H, T)``, the sequence in lanes: the layout
    in which the TPU's matmuls produce the projections and take the gradients back, so no
    transpose is materialised around them (with 64-wide heads, an ``(T, H)`` layout fills
    half of each 128-lane row and slowed the projections' matmuls too)."""
    qt, kt, vt = (jnp.transpose(x, (0, 2, 3, 1)) for x in (q, k, v))  # (B, heads, H, T)
    blocks = blocks.clipped(q.shape[1], k.shape[1])
    ot = _attend(qt, kt, vt, segment_ids, causal, blocks, interpret)
    return jnp.transpose(ot, (0, 3, 1, 2))  # (B, T, N, H)


def flash_attention(q, k, v, *, causal: bool, segment_ids=None,
                    blocks: FlashBlocks | None = None, interpret: bool | None = None):
    """``softmax(q k^T / sqrt(H)) v`` of ``q (B, T, N, H)`` over ``k``/``v (B, S, K, H)``
    (``N % K == 0``; query head ``n`` uses key/value head ``n // (N / K)``) by kdist's Pallas
    kernels.

    Args:
        causal: query ``t`` sees keys ``0..t`` (self-attention: ``S == T``).
        segment_ids: optional ``(B, T)`` document ids (``S == T``): a query sees only its own
            document's keys.
        blocks: tile sizes (default :class:`FlashBlocks`'s).
        interpret: run the kernels in Pallas' interpreter; default: unless JAX's default
            backend is a TPU.

    Returns ``(B, T, N, H)`` in the query's dtype.
    """
    from kdist.kernels.sharding import per_device

    blocks = blocks or FlashBlocks()
    groups = q.shape[2] // k.shape[2]
    if not supports(q.shape[1], k.shape[1], q.shape[-1], groups, blocks):
        raise ValueError(
            f"kdist's flash attention takes lengths in whole tiles of {blocks} (multiples "
            f"of {LANES}) and an example's heads whole in VMEM; got {q.shape[1]} queries over "
            f"{k.shape[1]} keys, head size {q.shape[-1]}, {groups} query heads per key head. "
            f"Use attention_implementation='splash' or 'chunked' for these shapes.")
    if (causal or segment_ids is not None) and k.shape[1] != q.shape[1]:
        raise ValueError("Causal or document masks are those of self-attention: keys and "
                         f"queries must be the same tokens; got {q.shape[1]} queries over "
                         f"{k.shape[1]} keys.")
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    local = functools.partial(_local, causal=causal, blocks=blocks, interpret=interpret)
    return per_device(local, q, k, v, segment_ids, name="kdist's flash attention")

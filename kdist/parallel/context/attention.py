"""Attention across a sequence split over the ``seq`` axis: all-gather or ring.

Each device holds the queries, keys and values of its own tokens (``SequenceLayout``) and
computes its queries' attention over every key, as an online softmax over key chunks
(:mod:`kdist.online_softmax`, the math of one-device chunked attention), so no ``T x T``
probabilities exist anywhere and nothing but the outputs and each query's softmax
statistics is kept for the backward pass.

* ``"all_gather"`` (the default): all-gather the keys and values over ``seq``, attend the
  local queries over them. Its backward pass reduce-scatters their gradients (JAX's
  transpose of the all-gather). Memory: the gathered keys and values of every layer are
  kept for the backward pass, ``O(T)`` per device.
* ``"ring"``: keys and values travel around the ring with ``ppermute``; each step sends
  the block it holds on while it attends it (the transfer and the compute are independent,
  so the scheduler can overlap them). The backward pass (a ``jax.custom_vjp``) sends the
  blocks around again, with their gradient accumulators travelling beside them and
  arriving, complete, back at their owner. Memory ``O(T / n)``. Per layer and step each
  device sends ``2(n-1)`` blocks forward, ``2(n-1)`` blocks and ``2n`` float32 gradient
  blocks backward (:func:`kdist.parallel.context.cost.ring_bytes`).

Grouped-query attention sends only the key/value heads. Causal attention skips, by a
``lax.cond``, every (query run, key chunk) tile wholly in the future: with the balanced
layout every device then computes the same number of tiles
(:func:`kdist.parallel.context.cost.tile_counts`).
Visibility follows Keras: True where a query may attend a key, a fully masked row attends
uniformly, masked logits get no gradient. The masks built here are those kdist's models
use: causal (by true positions), same document (segment ids), padded keys.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from kdist.online_softmax import (
    chunk_gradients,
    online_finish,
    online_init,
    online_update,
    softmax_delta,
    varying_union,
)
from kdist.parallel.constraints import to_varying
from kdist.parallel.context.layout import AXIS, SequenceLayout
from kdist.parallel.layout import CONTEXT_PARALLEL

# Keys per chunk when the model sets no attention_chunk_size: (B, N, T/2n, 512) float32
# logits per tile, never kept.
DEFAULT_CHUNK = 512
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Config:
    layout: SequenceLayout
    causal: bool
    chunk: int  # keys per chunk: divides a run
    skip: bool  # skip tiles wholly in the future (causal, no key mask)

    @property
    def run_length(self) -> int:
        return self.layout.local_length // self.layout.runs


def chunk_for(layout: SequenceLayout, chunk_size: int | None) -> int:
    """Keys per chunk: the largest divisor of a run (``T / n`` or ``T / 2n``) not above
    ``chunk_size`` (default :data:`DEFAULT_CHUNK`), so tiles align with the runs."""
    run = layout.local_length // layout.runs
    limit = min(run, chunk_size or DEFAULT_CHUNK)
    return max(d for d in range(1, limit + 1) if run % d == 0)


def _chunks(x, chunk):
    """``(B, L, ...) -> (L / chunk, B, chunk, ...)``: the scan runs over the leading axis."""
    if x is None:
        return None
    b, length = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, length // chunk, chunk, *x.shape[2:]), 1, 0)


def _codes(q_pos, k_pos, q_seg, k_seg, k_valid, causal):
    """Visibility codes ``(Bm, 1, 1, Tq, c)`` int8 (1 attend, 0 masked) of one tile."""
    vis = jnp.ones((1, q_pos.shape[0], k_pos.shape[0]), bool)
    if causal:
        vis = vis & (q_pos[:, None] >= k_pos[None, :])[None]
    if q_seg is not None:
        vis = vis & (q_seg[:, :, None] == k_seg[:, None, :])
    if k_valid is not None:
        vis = vis & k_valid[:, None, :].astype(bool)
    return vis.astype(jnp.int8)[:, None, None]


class _Queries:
    """One device's queries as runs of contiguous positions, with their masks' data."""

    def __init__(self, q5, segments, config: _Config):
        layout, run = config.layout, config.run_length
        me = jax.lax.axis_index(AXIS)
        self.positions = jnp.asarray(layout.table(), jnp.int32)[me].reshape(layout.runs, run)
        local = None
        if segments is not None:  # (B, T) layout order -> this device's (B, T / n)
            local = jax.lax.dynamic_slice_in_dim(segments, me * layout.local_length,
                                                 layout.local_length, axis=1)
        self.runs = [q5[:, r * run:(r + 1) * run] for r in range(layout.runs)]
        self.segments = [None if local is None else local[:, r * run:(r + 1) * run]
                         for r in range(layout.runs)]


def _keys(k, v, positions, segments, valid, chunk):
    """Key chunks and their masks' data, as the scans' ``xs``."""
    return (_chunks(k, chunk), _chunks(v, chunk), positions.reshape(-1, chunk),
            _chunks(segments, chunk), _chunks(valid, chunk))


def _needed(q_pos, k_pos, config):
    """Whether a tile has any visible pair (always, unless causal skipping applies): runs
    and chunks are increasing ranges of positions."""
    return q_pos[-1] >= k_pos[0] if config.skip else jnp.bool_(True)


def _attend_keys(states, count, queries, keys, config, scale):
    """Every query run's online softmax over the key chunks ``keys``; ``count`` the tiles
    computed (the rest were wholly in the future)."""
    out = []
    for r, state in enumerate(states):
        q_r, q_pos, q_seg = queries.runs[r], queries.positions[r], queries.segments[r]

        def step(carry, xs, q_r=q_r, q_pos=q_pos, q_seg=q_seg):
            state, count = carry
            k_j, v_j, pos_j, seg_j, val_j = xs

            def compute(state):
                vis = _codes(q_pos, pos_j, q_seg, seg_j, val_j, config.causal)
                return online_update(state, q_r, k_j, v_j, vis, scale)

            needed = _needed(q_pos, pos_j, config)
            state = jax.lax.cond(needed, compute, lambda s: s, state)
            return (state, count + needed.astype(jnp.int32)), None

        (state, count), _ = jax.lax.scan(step, (state, count), keys)
        out.append(state)
    return out, count


def _grad_keys(queries, d_outs, deltas, stats, keys, config, scale):
    """Gradients of the key chunks ``keys``: ``(dq per run, dk, dv (M, B, c, K, H))``,
    float32."""
    dqs, dk, dv = [], 0.0, 0.0
    for r, q_r in enumerate(queries.runs):
        q_pos, q_seg = queries.positions[r], queries.segments[r]
        d_out, delta, (peak, total) = d_outs[r], deltas[r], stats[r]

        axes = varying_union(q_r, d_out, peak, *jax.tree.leaves(keys))

        def step(dq, xs, q_r=q_r, q_pos=q_pos, q_seg=q_seg, d_out=d_out, delta=delta,
                 peak=peak, total=total, axes=axes):
            k_j, v_j, pos_j, seg_j, val_j = xs

            def compute(_):
                vis = _codes(q_pos, pos_j, q_seg, seg_j, val_j, config.causal)
                return chunk_gradients(q_r, k_j, v_j, vis, d_out, delta, peak, total, scale)

            def skip(_):
                zeros = to_varying(jnp.zeros(k_j.shape, _F32), axes)
                return to_varying(jnp.zeros(q_r.shape, _F32), axes), zeros, zeros

            dq_j, dk_j, dv_j = jax.lax.cond(_needed(q_pos, pos_j, config), compute, skip, None)
            return dq + dq_j, (dk_j, dv_j)

        dq0 = to_varying(jnp.zeros(q_r.shape, _F32), axes)
        dq, (dk_r, dv_r) = jax.lax.scan(step, dq0, keys)
        dqs.append(dq)
        dk, dv = dk + dk_r, dv + dv_r
    return dqs, dk, dv


def _unchunk(x):
    """``(M, B, c, ...) -> (B, M c, ...)``."""
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])


def _scale(q5):
    return 1.0 / math.sqrt(q5.shape[-1])


def _init(queries, count_like, *like):
    states = [online_init(q_r, *like, queries.positions) for q_r in queries.runs]
    count = to_varying(jnp.zeros((), jnp.int32), varying_union(count_like, queries.positions))
    return states, count


def _finish(states, dtype):
    outs, stats = zip(*(online_finish(s, dtype) for s in states))
    return jnp.concatenate(outs, axis=1), list(stats)


# === all-gather: local queries over the gathered keys and values ===

def _gathered_forward(q5, k_all, v_all, segments, valid, config):
    queries = _Queries(q5, segments, config)
    positions = jnp.asarray(config.layout.order(), jnp.int32)
    keys = _keys(k_all, v_all, positions, segments, valid, config.chunk)
    states, count = _init(queries, q5, k_all, v_all, segments, valid)
    states, count = _attend_keys(states, count, queries, keys, config, _scale(q5))
    out, stats = _finish(states, q5.dtype)
    return out, stats, count


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _gathered(q5, k_all, v_all, segments, valid, config):
    return _gathered_forward(q5, k_all, v_all, segments, valid, config)[0]


def _gathered_fwd(q5, k_all, v_all, segments, valid, config):
    out, stats, _ = _gathered_forward(q5, k_all, v_all, segments, valid, config)
    return out, (q5, k_all, v_all, segments, valid, out, stats)


def _gathered_bwd(config, residuals, d_out):
    q5, k_all, v_all, segments, valid, out, stats = residuals
    queries = _Queries(q5, segments, config)
    run = config.run_length
    d_outs = [d_out[:, r * run:(r + 1) * run] for r in range(config.layout.runs)]
    deltas = [softmax_delta(d, out[:, r * run:(r + 1) * run]) for r, d in enumerate(d_outs)]
    positions = jnp.asarray(config.layout.order(), jnp.int32)
    keys = _keys(k_all, v_all, positions, segments, valid, config.chunk)
    dqs, dk, dv = _grad_keys(queries, d_outs, deltas, stats, keys, config, _scale(q5))
    dq = jnp.concatenate(dqs, axis=1).astype(q5.dtype)
    return dq, _unchunk(dk).astype(k_all.dtype), _unchunk(dv).astype(v_all.dtype), None, None


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


# === ring: key/value blocks travel around the seq axis ===

def _send(x, n, shift=1):
    """This device's block to a neighbour on the ring (device i to i + shift mod n)."""
    return jax.lax.ppermute(x, AXIS, perm=[(i, (i + shift) % n) for i in range(n)])


def _block(layout, j, segments, valid):
    """Block ``j``'s true positions ``(T / n,)`` and its masks' data ``(B, T / n)``."""
    positions = jnp.asarray(layout.table(), jnp.int32)[j]

    def take(x):
        if x is None:
            return None
        return jax.lax.dynamic_slice_in_dim(x, j * layout.local_length, layout.local_length,
                                            axis=1)

    return positions, take(segments), take(valid)


def _ring_forward(q5, k, v, segments, valid, config):
    n = config.layout.devices
    me = jax.lax.axis_index(AXIS)
    queries = _Queries(q5, segments, config)
    states, count = _init(queries, q5, k, v, segments, valid)
    for step in range(n):  # unrolled: each transfer is one instruction of the program
        if step + 1 < n:  # on its way while this block is attended
            k_next, v_next = _send(k, n), _send(v, n)
        positions, seg_j, val_j = _block(config.layout, (me - step) % n, segments, valid)
        keys = _keys(k, v, positions, seg_j, val_j, config.chunk)
        states, count = _attend_keys(states, count, queries, keys, config, _scale(q5))
        if step + 1 < n:
            k, v = k_next, v_next
    out, stats = _finish(states, q5.dtype)
    return out, stats, count


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring(q5, k, v, segments, valid, config):
    return _ring_forward(q5, k, v, segments, valid, config)[0]


def _ring_fwd(q5, k, v, segments, valid, config):
    out, stats, _ = _ring_forward(q5, k, v, segments, valid, config)
    return out, (q5, k, v, segments, valid, out, stats)


def _ring_bwd(config, residuals, d_out):
    q5, k, v, segments, valid, out, stats = residuals
    n, run = config.layout.devices, config.run_length
    me = jax.lax.axis_index(AXIS)
    queries = _Queries(q5, segments, config)
    d_outs = [d_out[:, r * run:(r + 1) * run] for r in range(config.layout.runs)]
    deltas = [softmax_delta(d, out[:, r * run:(r + 1) * run]) for r, d in enumerate(d_outs)]
    axes = varying_union(q5, k, v, d_out, queries.positions)
    dq = [to_varying(jnp.zeros(q.shape, _F32), axes) for q in queries.runs]
    # Blocks go round the other way (device i to i - 1): sent the same way, the transfers
    # would repeat the forward pass's, and XLA would merge them and keep every received
    # block alive until here: O(T) memory per layer, the all-gather's. The gradient of the
    # block a device holds travels with it; after n steps it has met every device's
    # queries and is one step short of its owner.
    dk, dv = (to_varying(jnp.zeros(x.shape, _F32), axes) for x in (k, v))
    for step in range(n):
        if step + 1 < n:
            k_next, v_next = _send(k, n, -1), _send(v, n, -1)
        positions, seg_j, val_j = _block(config.layout, (me + step) % n, segments, valid)
        keys = _keys(k, v, positions, seg_j, val_j, config.chunk)
        dq_j, dk_j, dv_j = _grad_keys(queries, d_outs, deltas, stats, keys, config,
                                      _scale(q5))
        dq = [a + b for a, b in zip(dq, dq_j)]
        dk, dv = _send(dk + _unchunk(dk_j), n, -1), _send(dv + _unchunk(dv_j), n, -1)
        if step + 1 < n:
            k, v = k_next, v_next
    dq = jnp.concatenate(dq, axis=1).astype(q5.dtype)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


# === entry points ===

def _config(q, layout, causal, chunk_size, valid):
    return _Config(layout, causal, chunk_for(layout, chunk_size),
                   skip=causal and valid is None)


def local_attention(q, k, v, *, layout: SequenceLayout, variant: str = "all_gather",
                    causal: bool = True, segments=None, key_valid=None,
                    chunk_size: int | None = None):
    """One device's attention over the whole split sequence, inside ``shard_map`` (or
    kdist's per-device region) with ``seq`` manual.

    Args:
        q: this device's queries ``(B, T / n, N, H)``; ``k``, ``v``: its keys and values
            ``(B, T / n, K, H)``, ``N % K == 0``; tokens in ``layout`` order.
        layout: the split (:class:`~kdist.parallel.context.layout.SequenceLayout`).
        variant: ``"all_gather"`` or ``"ring"``.
        causal: a query sees the keys at true positions up to its own.
        segments: ``(B, T)`` document ids of every token (layout order): a query sees only
            its own document's keys.
        key_valid: ``(B, T)`` booleans of every token: False keys (padding) are masked.
        chunk_size: keys per chunk (see :func:`chunk_for`).

    Returns:
        ``(B, T / n, N, H)`` in the query's dtype.

    Example:
        >>> mesh = jax.make_mesh((8,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> spec = jax.sharding.PartitionSpec(None, "seq")
        >>> f = jax.shard_map(lambda q, k, v: local_attention(
        ...     q, k, v, layout=SequenceLayout(32, 8, True), variant="ring"),
        ...     mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        >>> f(*(jnp.ones((1, 32, 2, 8)),) * 3).shape
        (1, 32, 2, 8)
    """
    if variant not in CONTEXT_PARALLEL:
        raise ValueError(f"Unknown context-parallel attention {variant!r}; use one of "
                         f"{CONTEXT_PARALLEL}.")
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    q5 = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
    config = _config(q, layout, causal, chunk_size, key_valid)
    if variant == "ring":
        out = _ring(q5, k, v, segments, key_valid, config)
    else:
        k_all, v_all = (jax.lax.all_gather(x, AXIS, axis=1, tiled=True) for x in (k, v))
        out = _gathered(q5, k_all, v_all, segments, key_valid, config)
    return out.reshape(batch, length, heads, head_dim)


def local_tile_count(q, k, v, *, layout, variant="all_gather", causal=True, segments=None,
                     key_valid=None, chunk_size=None):
    """The (query run, key chunk) tiles :func:`local_attention`'s forward pass computes on
    this device (the others are skipped): the measure of its attention work."""
    batch, length, heads, head_dim = q.shape
    q5 = q.reshape(batch, length, k.shape[2], heads // k.shape[2], head_dim)
    config = _config(q, layout, causal, chunk_size, key_valid)
    if variant == "ring":
        return _ring_forward(q5, k, v, segments, key_valid, config)[2]
    k_all, v_all = (jax.lax.all_gather(x, AXIS, axis=1, tiled=True) for x in (k, v))
    return _gathered_forward(q5, k_all, v_all, segments, key_valid, config)[2]

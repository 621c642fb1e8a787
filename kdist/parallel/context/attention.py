"""Attention across a sequence split over the ``seq`` axis: all-gather or ring.

Each device holds the queries, keys and values of its own tokens (``SequenceLayout``) and
computes its queries' attention over every key, as an online softmax over key chunks
(:mod:`kdist.parallel.online_softmax`, the math of one-device chunked attention), so no ``T x T``
probabilities exist anywhere and nothing but the outputs and each query's softmax
statistics is kept for the backward pass.

* ``"all_gather"`` (the default): all-gather the keys and values over ``seq``, attend the
  local queries over them. Its backward pass reduce-scatters their gradients (JAX's
  transpose of the all-gather). Memory: the gathered keys and values of every layer are
  kept for the backward pass, ``O(T)`` per device.
* ``"ring"``: keys and values travel around the ring with ``ppermute``; each step of a
  ``lax.scan`` sends the block it holds on while it attends it (the transfer and the
  compute are independent, so the scheduler can overlap them; the loop keeps two blocks
  alive). The backward pass (a ``jax.custom_vjp``) sends the
  blocks around again, with their gradient accumulators travelling beside them and
  arriving, complete, back at their owner. Memory ``O(T / n)``. Per layer and step each
  device sends ``2(n-1)`` blocks forward, ``2(n-1)`` blocks and ``2n`` float32 gradient
  blocks backward (:func:`kdist.parallel.context.cost.ring_bytes`).

Queries are tiled like keys (tiles of :func:`chunk_for` tokens), so the logits live one
``(B, N, c, c)`` tile at a time whatever the length. Grouped-query attention sends only the
key/value heads. Causal attention skips, by a ``lax.cond``, every (query tile, key chunk)
pair wholly in the future: with the balanced layout every device then computes the same
number of tiles
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

from kdist.parallel.config import CONTEXT_PARALLEL
from kdist.parallel.context.token_layout import AXIS, SequenceLayout
from kdist.parallel.online_softmax import (
    chunk_gradients,
    online_finish,
    online_init,
    online_update,
    softmax_delta,
    varying_union,
)
from kdist.parallel.region import to_varying

# Queries and keys per tile when the model sets no attention_chunk_size: (B, N, 256, 256)
# float32 logits per tile, whatever the sequence length; never kept.
DEFAULT_CHUNK = 256
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Config:
    layout: SequenceLayout
    causal: bool
    chunk: int  # queries per tile and keys per chunk: divides a run
    skip: bool  # skip tiles wholly in the future (causal, no key mask)


def chunk_for(layout: SequenceLayout, chunk_size: int | None) -> int:
    """Queries per tile and keys per chunk: the largest divisor of a run (``T / n``, or
    ``T / 2n`` balanced) not above ``chunk_size`` (default :data:`DEFAULT_CHUNK`), so that
    a tile never spans two runs of positions."""
    run = layout.local_length // layout.runs
    limit = min(run, chunk_size or DEFAULT_CHUNK)
    return max(d for d in range(1, limit + 1) if run % d == 0)


def _chunks(x, chunk):
    """``(B, L, ...) -> (L / chunk, B, chunk, ...)``: the scans run over the leading axis."""
    if x is None:
        return None
    b, length = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, length // chunk, chunk, *x.shape[2:]), 1, 0)


def _unchunk(x):
    """``(M, B, c, ...) -> (B, M c, ...)``."""
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])


def _codes(q_pos, k_pos, q_seg, k_seg, k_valid, causal):
    """Visibility codes ``(Bm, 1, 1, cq, c)`` int8 (1 attend, 0 masked) of one tile."""
    vis = jnp.ones((1, q_pos.shape[0], k_pos.shape[0]), bool)
    if causal:
        vis = vis & (q_pos[:, None] >= k_pos[None, :])[None]
    if q_seg is not None:
        vis = vis & (q_seg[:, :, None] == k_seg[:, None, :])
    if k_valid is not None:
        vis = vis & k_valid[:, None, :].astype(bool)
    return vis.astype(jnp.int8)[:, None, None]


def _queries(q5, segments, config: _Config):
    """This device's query tiles and their masks' data, as the outer scans' ``xs``:
    ``q (Q, B, c, K, G, H)``, true positions ``(Q, c)``, segment ids ``(Q, B, c)``."""
    layout, chunk = config.layout, config.chunk
    me = jax.lax.axis_index(AXIS)
    positions = jnp.asarray(layout.table(), jnp.int32)[me].reshape(-1, chunk)
    local = None
    if segments is not None:  # (B, T) layout order -> this device's (B, T / n)
        local = jax.lax.dynamic_slice_in_dim(segments, me * layout.local_length,
                                             layout.local_length, axis=1)
    return _chunks(q5, chunk), positions, _chunks(local, chunk)


def _keys(k, v, positions, segments, valid, chunk):
    """Key chunks and their masks' data, as the inner scans' ``xs``."""
    return (_chunks(k, chunk), _chunks(v, chunk), positions.reshape(-1, chunk),
            _chunks(segments, chunk), _chunks(valid, chunk))


def _needed(q_pos, k_pos, config):
    """Whether a tile has any visible pair (always, unless causal skipping applies): tiles
    and chunks are increasing ranges of positions."""
    return q_pos[-1] >= k_pos[0] if config.skip else jnp.bool_(True)


def _scale(q5):
    return 1.0 / math.sqrt(q5.shape[-1])


def _attend_keys(states, count, queries, keys, config, scale):
    """Every query tile's online softmax (``states``, stacked over tiles) over the key
    chunks ``keys``; ``count`` the tiles computed (the others were wholly in the future)."""

    def per_tile(count, xs):
        state, q_t, q_pos, q_seg = xs

        def step(carry, kxs):
            state, count = carry
            k_j, v_j, pos_j, seg_j, val_j = kxs

            def compute(state):
                vis = _codes(q_pos, pos_j, q_seg, seg_j, val_j, config.causal)
                return online_update(state, q_t, k_j, v_j, vis, scale)

            needed = _needed(q_pos, pos_j, config)
            state = jax.lax.cond(needed, compute, lambda s: s, state)
            return (state, count + needed.astype(jnp.int32)), None

        (state, count), _ = jax.lax.scan(step, (state, count), keys)
        return count, state

    count, states = jax.lax.scan(per_tile, count, (states, *queries))
    return states, count


def _grad_keys(queries, d_outs, deltas, stats, keys, config, scale):
    """Gradients of the key chunks ``keys``: ``(dq (Q, B, c, K, G, H), dk, dv (M, B, c, K,
    H))``, float32."""
    axes = varying_union(*jax.tree.leaves((queries, d_outs, stats, keys)))
    zeros = to_varying(jnp.zeros(keys[0].shape, _F32), axes)

    def per_tile(acc, xs):
        q_t, q_pos, q_seg, d_out, delta, (peak, total) = xs

        def step(dq, kxs):
            k_j, v_j, pos_j, seg_j, val_j = kxs

            def compute(_):
                vis = _codes(q_pos, pos_j, q_seg, seg_j, val_j, config.causal)
                return chunk_gradients(q_t, k_j, v_j, vis, d_out, delta, peak, total, scale)

            def skip(_):
                none = to_varying(jnp.zeros(k_j.shape, _F32), axes)
                return to_varying(jnp.zeros(q_t.shape, _F32), axes), none, none

            dq_j, dk_j, dv_j = jax.lax.cond(_needed(q_pos, pos_j, config), compute, skip, None)
            return dq + dq_j, (dk_j, dv_j)

        dq, (dk_t, dv_t) = jax.lax.scan(step, to_varying(jnp.zeros(q_t.shape, _F32), axes),
                                        keys)
        return (acc[0] + dk_t, acc[1] + dv_t), dq

    (dk, dv), dq = jax.lax.scan(per_tile, (zeros, zeros),
                                (*queries, d_outs, deltas, stats))
    return dq, dk, dv


def _init(queries, *like):
    """Empty online-softmax states of every query tile, and a zero tile count."""
    q = queries[0]
    axes = varying_union(*jax.tree.leaves(queries), *like)
    one = online_init(q[0], *like, queries[1])
    states = tuple(to_varying(jnp.broadcast_to(x, (q.shape[0], *x.shape)), axes) for x in one)
    return states, to_varying(jnp.zeros((), jnp.int32), axes)


def _finish(states, dtype):
    """``(out (B, L, K, G, H), stats per tile)`` from the finished tiles."""
    outs, stats = jax.vmap(lambda s: online_finish(s, dtype))(states)
    return _unchunk(outs), stats


def _backward_inputs(q5, out, d_out, segments, config):
    queries = _queries(q5, segments, config)
    d_outs = _chunks(d_out, config.chunk)
    deltas = jax.vmap(softmax_delta)(d_outs, _chunks(out, config.chunk))
    return queries, d_outs, deltas


# === all-gather: local queries over the gathered keys and values ===

def _gathered_forward(q5, k_all, v_all, segments, valid, config):
    queries = _queries(q5, segments, config)
    positions = jnp.asarray(config.layout.order(), jnp.int32)
    keys = _keys(k_all, v_all, positions, segments, valid, config.chunk)
    states, count = _init(queries, k_all, v_all, segments, valid)
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
    queries, d_outs, deltas = _backward_inputs(q5, out, d_out, segments, config)
    positions = jnp.asarray(config.layout.order(), jnp.int32)
    keys = _keys(k_all, v_all, positions, segments, valid, config.chunk)
    dq, dk, dv = _grad_keys(queries, d_outs, deltas, stats, keys, config, _scale(q5))
    return (_unchunk(dq).astype(q5.dtype), _unchunk(dk).astype(k_all.dtype),
            _unchunk(dv).astype(v_all.dtype), None, None)


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
    n, scale = config.layout.devices, _scale(q5)
    me = jax.lax.axis_index(AXIS)
    queries = _queries(q5, segments, config)

    def attend(states, count, k, v, step):  # the block of device me - step
        positions, seg_j, val_j = _block(config.layout, (me - step) % n, segments, valid)
        keys = _keys(k, v, positions, seg_j, val_j, config.chunk)
        return _attend_keys(states, count, queries, keys, config, scale)

    def step(carry, step):
        states, count, k, v = carry
        k_next, v_next = _send(k, n), _send(v, n)  # on its way while this block is attended
        return (*attend(states, count, k, v, step), k_next, v_next), None

    # A loop, not unrolled: unrolled, XLA would run every transfer first (they depend on
    # nothing but each other) and keep all n blocks: the all-gather's memory.
    (states, count, k, v), _ = jax.lax.scan(step, (*_init(queries, k, v, segments, valid),
                                                   k, v), jnp.arange(n - 1))
    states, count = attend(states, count, k, v, n - 1)  # the last block: nothing to send
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
    n, scale = config.layout.devices, _scale(q5)
    me = jax.lax.axis_index(AXIS)
    queries, d_outs, deltas = _backward_inputs(q5, out, d_out, segments, config)
    axes = varying_union(q5, k, v, d_out, queries[1])

    def grads(k, v, step):  # of the block of device me + step
        positions, seg_j, val_j = _block(config.layout, (me + step) % n, segments, valid)
        keys = _keys(k, v, positions, seg_j, val_j, config.chunk)
        return _grad_keys(queries, d_outs, deltas, stats, keys, config, scale)

    # Blocks go round the other way (device i to i - 1): sent the same way, the transfers
    # would repeat the forward pass's, and XLA would merge them and keep every received
    # block alive until here. The gradient of the block a device holds travels with it;
    # after n steps it has met every device's queries and is one step short of its owner.
    def step(carry, step):
        dq, dk, dv, k, v = carry
        k_next, v_next = _send(k, n, -1), _send(v, n, -1)
        dq_j, dk_j, dv_j = grads(k, v, step)
        dk, dv = _send(dk + _unchunk(dk_j), n, -1), _send(dv + _unchunk(dv_j), n, -1)
        return (dq + dq_j, dk, dv, k_next, v_next), None

    zeros = [to_varying(jnp.zeros(x.shape, _F32), axes) for x in (queries[0], k, v)]
    (dq, dk, dv, k_last, v_last), _ = jax.lax.scan(step, (*zeros, k, v), jnp.arange(n - 1))
    dq_j, dk_j, dv_j = grads(k_last, v_last, n - 1)
    dk, dv = _send(dk + _unchunk(dk_j), n, -1), _send(dv + _unchunk(dv_j), n, -1)
    return (_unchunk(dq + dq_j).astype(q5.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


# === entry points ===

def _config(layout, causal, chunk_size, valid):
    # Skipping the future is exact when every query sees itself: not so with padded keys
    # (a query whose visible keys are all padding attends uniformly over every key, as
    # Keras' attention does).
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
        layout: the split (:class:`~kdist.parallel.context.token_layout.SequenceLayout`).
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
    config = _config(layout, causal, chunk_size, key_valid)
    if variant == "ring":
        out = _ring(q5, k, v, segments, key_valid, config)
    else:
        k_all, v_all = (jax.lax.all_gather(x, AXIS, axis=1, tiled=True) for x in (k, v))
        out = _gathered(q5, k_all, v_all, segments, key_valid, config)
    return out.reshape(batch, length, heads, head_dim)


def local_tile_count(q, k, v, *, layout, variant="all_gather", causal=True, segments=None,
                     key_valid=None, chunk_size=None):
    """The (query tile, key chunk) pairs :func:`local_attention`'s forward pass computes on
    this device (the others are skipped): the measure of its attention work."""
    batch, length, heads, head_dim = q.shape
    q5 = q.reshape(batch, length, k.shape[2], heads // k.shape[2], head_dim)
    config = _config(layout, causal, chunk_size, key_valid)
    if variant == "ring":
        return _ring_forward(q5, k, v, segments, key_valid, config)[2]
    k_all, v_all = (jax.lax.all_gather(x, AXIS, axis=1, tiled=True) for x in (k, v))
    return _gathered_forward(q5, k_all, v_all, segments, key_valid, config)[2]

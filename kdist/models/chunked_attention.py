"""Memory-efficient attention over key chunks (``softmax(Q K^T / sqrt(H)) V`` in plain JAX,
:func:`chunked_attention`): what ``attention_implementation="chunked"`` runs.

Where no fused attention kernel runs (XLA:CPU; a GPU with a document mask, which cuDNN's
path in Keras does not take; a TPU without Splash), ``keras.ops.dot_product_attention``
builds the ``(B, N, T, S)`` float32 probabilities of every layer and keeps them for the
backward pass: for gpt2-small at batch 8 x 1024 that is 12 layers x 8 x 12 x 1024^2 x 4 bytes
= 4.8 GB, a fifth of the step's peak. :func:`chunked_attention` computes the same function
over chunks of keys with an online softmax (the recurrences of Milakov & Gimelshein 2018,
Rabe & Staats 2021 and FlashAttention) and keeps only the output and each query's
log-sum-exp; its backward pass (a ``jax.custom_vjp``) recomputes one chunk of probabilities
at a time. Memory for attention falls from ``O(T S)`` to ``O(T c)`` per head; the price is
one more ``Q K^T`` product per chunk in the backward pass (~+4% of gpt2-small's FLOPs).

It is not a kernel: on a GPU, cuDNN's flash attention (what kdist uses in plain causal
training) is faster. Masks follow Keras: True where a query may attend a key, a fully
masked row attends uniformly, and masked logits get no gradient.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kdist.kernels import splash
from kdist.models import remat
from kdist.parallel.online_softmax import (
    chunk_gradients,
    online_finish,
    online_init,
    online_update,
    softmax_delta,
    varying_union,
)
from kdist.parallel.region import to_varying

_F32 = jnp.float32


def chunked_attention(query, key, value, mask=None, is_causal: bool = False,
                      chunk_size: int = 128):
    """Attention of ``query (B, T, N, H)`` over ``key``/``value (B, S, K, H)``, ``N % K == 0``.

    Args:
        mask: optional boolean array broadcastable to ``(B, 1, T, S)`` (one mask for all
            heads), True where a query may attend a key.
        is_causal: query ``t`` sees keys ``0..t`` (on top of ``mask``).
        chunk_size: keys per chunk; ``S`` need not divide by it (the last chunk is padded
            with keys that are masked out).

    Returns:
        ``(B, T, N, H)`` in the query's dtype: ``keras.ops.dot_product_attention(query,
        key, value, mask=mask, is_causal=is_causal)``, up to float rounding.

    Example:
        >>> q = jnp.ones((2, 8, 4, 16)); kv = jnp.ones((2, 8, 2, 16))
        >>> chunked_attention(q, kv, kv, is_causal=True, chunk_size=4).shape
        (2, 8, 4, 16)
    """
    batch, length, heads, head_dim = query.shape
    keys, kv_heads = key.shape[1], key.shape[2]
    if key.shape != value.shape or key.shape[0] != batch or key.shape[3] != head_dim:
        raise ValueError(f"chunked_attention needs key and value of shape (B, S, K, H) with "
                         f"B, H from the query {query.shape}; got key {key.shape}, value "
                         f"{value.shape}.")
    if heads % kv_heads:
        raise ValueError(f"The query's {heads} heads must be a multiple of the key's "
                         f"{kv_heads} (grouped-query attention).")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}.")
    chunk = min(chunk_size, keys)
    chunks = -(-keys // chunk)
    pad = chunks * chunk - keys

    visible = _key_mask(mask, batch, length, keys, chunk, pad)  # (Bm, Tm, chunks, c)
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        key, value = jnp.pad(key, widths), jnp.pad(value, widths)
    # (chunks, B, c, K, H): the scan runs over the leading axis.
    k = jnp.moveaxis(key.reshape(batch, chunks, chunk, kv_heads, head_dim), 1, 0)
    v = jnp.moveaxis(value.reshape(batch, chunks, chunk, kv_heads, head_dim), 1, 0)
    q = query.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)  # (B, T, K, G, H)
    out = _attend(q, k, v, jnp.moveaxis(visible, 2, 0), is_causal)
    return out.reshape(batch, length, heads, head_dim)


def _key_mask(mask, batch, length, keys, chunk, pad):
    """The user's mask as ``(Bm, Tm, chunks, c)`` int8 codes (Bm in {1, B}, Tm in {1, T}):
    1 attend, 0 masked, -1 a padding key."""
    if mask is None:
        m = jnp.ones((1, 1, keys), bool)
    else:
        m = jnp.asarray(mask).astype(bool)
        m = m.reshape((1,) * (4 - m.ndim) + m.shape)
        if m.ndim != 4 or m.shape[1] != 1 or any(
                got not in (1, want) for got, want in zip(m.shape, (batch, 1, length, keys))):
            raise ValueError(f"chunked_attention takes a mask broadcastable to (B, 1, T, S) = "
                             f"({batch}, 1, {length}, {keys}) (one mask for every head); got "
                             f"shape {tuple(jnp.shape(mask))}.")
        m = jnp.broadcast_to(m[:, 0], m.shape[:1] + m.shape[2:3] + (keys,))
    m = m.astype(jnp.int8)  # 1: attend, 0: masked (Keras' large negative logit)
    if pad:  # -1: a padding key, left out even of a fully masked row's uniform average
        m = jnp.pad(m, ((0, 0), (0, 0), (0, pad)), constant_values=-1)
    return m.reshape(m.shape[:2] + (-1, chunk))


def _visible(mask_j, j, chunk, length, is_causal):
    """Key chunk ``j``'s mask (1 attend, 0 masked, -1 padding), broadcastable to
    ``(B, K, G, T, c)``."""
    vis = mask_j  # (Bm, Tm, c)
    if is_causal:
        key_pos = j * chunk + jnp.arange(chunk)
        future = jnp.arange(length)[:, None] < key_pos[None, :]  # (T, c)
        vis = jnp.where(future & (vis == 1), 0, vis)  # (Bm, T, c)
    return vis[:, None, None]


def _forward(q, k, v, mask, is_causal):
    length, head_dim = q.shape[1], q.shape[-1]
    chunk = k.shape[2]
    scale = 1.0 / math.sqrt(head_dim)

    def step(carry, xs):
        k_j, v_j, mask_j, j = xs
        vis = _visible(mask_j, j, chunk, length, is_causal)
        return online_update(carry, q, k_j, v_j, vis, scale), None

    # Inside shard_map (kdist.parallel.reduction) the carries vary per device like q, k and v.
    init = online_init(q, k, v, mask)
    carry, _ = jax.lax.scan(step, init, (k, v, mask, jnp.arange(k.shape[0])))
    return online_finish(carry, q.dtype)  # (B, T, K, G, H); (B, K, G, T) each


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attend(q, k, v, mask, is_causal):
    return _forward(q, k, v, mask, is_causal)[0]


def _attend_fwd(q, k, v, mask, is_causal):
    out, stats = _forward(q, k, v, mask, is_causal)
    # Named: a rematerialisation policy that keeps them ("minimal") skips this forward.
    out, stats = remat.named((out, stats), splash.RESIDUALS)
    return out, (q, k, v, mask, out, stats)


def _attend_bwd(is_causal, residuals, d_out):
    q, k, v, mask, out, (peak, total) = residuals
    length, head_dim = q.shape[1], q.shape[-1]
    chunk = k.shape[2]
    scale = 1.0 / math.sqrt(head_dim)
    delta = softmax_delta(d_out, out)  # once for all chunks

    def step(dq, xs):
        k_j, v_j, mask_j, j = xs
        vis = _visible(mask_j, j, chunk, length, is_causal)
        dq_j, dk_j, dv_j = chunk_gradients(q, k_j, v_j, vis, d_out, delta, peak, total, scale)
        return dq + dq_j, (dk_j.astype(k.dtype), dv_j.astype(v.dtype))

    dq = to_varying(jnp.zeros(q.shape, _F32), varying_union(q, k, v, mask, d_out))
    dq, (dk, dv) = jax.lax.scan(step, dq, (k, v, mask, jnp.arange(k.shape[0])))
    return dq.astype(q.dtype), dk, dv, None


_attend.defvjp(_attend_fwd, _attend_bwd)

"""The online-softmax recurrences of blockwise attention, shared by one-device chunked
attention (:func:`kdist.models.chunked_attention.chunked_attention`) and attention across a sequence
split over devices (:mod:`kdist.parallel.context`).

Queries are ``q (B, T, K, G, H)``: K key/value heads, G query heads per key/value head (G = 1
without grouped-query attention). A key chunk is ``(B, c, K, H)``; its *visibility codes*
``vis``, broadcastable to ``(B, K, G, T, c)``, are int8: 1 the query attends the key, 0 the key
is masked (Keras' large negative logit: a fully masked row attends uniformly), -1 the key is
padding (left out even of a fully masked row's uniform average). The recurrences are those
of Milakov & Gimelshein 2018, Rabe & Staats 2021 and FlashAttention: a running maximum and
sum per query, the output rescaled when the maximum grows; the backward pass recomputes one
chunk of probabilities at a time from them.

Example:
    >>> q = jnp.ones((1, 4, 1, 1, 8)); k = v = jnp.ones((1, 4, 1, 8))
    >>> state = online_update(online_init(q), q, k, v, jnp.ones((1, 1, 1, 4, 4), "int8"), 0.35)
    >>> online_finish(state, q.dtype)[0].shape
    (1, 4, 1, 1, 8)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kdist.parallel.region import to_varying, varying_axes

_F32 = jnp.float32
# Keras' masked logit (keras/src/backend/jax/nn.py): finite, so fully masked rows stay finite.
NEG_LOGIT = float(-0.7 * np.finfo(np.float32).max)


def varying_union(*arrays) -> frozenset:
    """The manual axes over which any of ``arrays`` varies (None entries ignored)."""
    return frozenset().union(*(varying_axes(a) for a in arrays if a is not None))


def logits(q, k_j, vis, scale):
    """Scaled float32 logits ``(B, K, G, T, c)`` of queries against a key chunk, with the
    codes applied (masked: ``NEG_LOGIT``; padding: ``-inf``)."""
    s = jnp.einsum("btkgh,bckh->bkgtc", q, k_j, preferred_element_type=_F32) * scale
    return jnp.where(vis == 1, s, jnp.where(vis == 0, NEG_LOGIT, -jnp.inf))  # (B, K, G, T, c)


def online_update(carry, q, k_j, v_j, vis, scale):
    """One key chunk into the online softmax of queries ``q (B, T, K, G, H)``.

    ``carry`` is ``(o (B, T, K, G, H) f32, peak (B, K, G, T) f32, total (B, K, G, T) f32)``:
    the unnormalised output, each query's running maximum logit and its running sum of
    ``exp(logit - peak)``; ``vis`` the chunk's codes (1 attend, 0 masked, -1 padding),
    broadcastable to ``(B, K, G, T, c)``. Shared with :mod:`kdist.parallel.context`.
    """
    o, peak, total = carry
    s = logits(q, k_j, vis, scale)
    peak_new = jnp.maximum(peak, s.max(-1))
    p = jnp.exp(s - peak_new[..., None])
    correction = jnp.exp(peak - peak_new)
    total = total * correction + p.sum(-1)
    o = o * jnp.moveaxis(correction, 3, 1)[..., None] + jnp.einsum(
        "bkgtc,bckh->btkgh", p.astype(v_j.dtype), v_j, preferred_element_type=_F32)
    return o, peak_new, total


def online_init(q, *like):
    """The empty online-softmax state of queries ``q (B, T, K, G, H)``, typed as varying
    over the manual axes of ``q`` and ``like`` (inside ``shard_map``)."""
    batch, length, kv_heads, groups, _ = q.shape
    stats = jnp.full((batch, kv_heads, groups, length), NEG_LOGIT, _F32)
    init = (jnp.zeros(q.shape, _F32), stats, jnp.zeros_like(stats))
    return tuple(to_varying(c, varying_union(q, *like)) for c in init)


def online_finish(carry, dtype):
    """``(out (B, T, K, G, H) in dtype, (peak, total))`` of a finished online softmax."""
    o, peak, total = carry
    # Max and sum, not their log-sum-exp: for a fully masked row peak = -0.7 * float32 max,
    # where adding log(total) would be lost to rounding.
    return (o / jnp.moveaxis(total, 3, 1)[..., None]).astype(dtype), (peak, total)


def chunk_gradients(q, k_j, v_j, vis, d_out, delta, peak, total, scale):
    """Gradients of one key chunk: ``(dq (B, T, K, G, H), dk_j, dv_j (B, c, K, H))``, all
    float32, from the forward pass's ``peak`` and ``total`` and ``delta = sum(dO * O)``
    ``(B, K, G, T)``. Masked logits get no gradient. Shared with
    :mod:`kdist.parallel.context`."""
    s = logits(q, k_j, vis, scale)
    p = jnp.exp(s - peak[..., None]) / total[..., None]  # (B, K, G, T, c)
    dv_j = jnp.einsum("bkgtc,btkgh->bckh", p.astype(d_out.dtype), d_out,
                      preferred_element_type=_F32)
    dp = jnp.einsum("btkgh,bckh->bkgtc", d_out, v_j, preferred_element_type=_F32)
    ds = jnp.where(vis == 1, p * (dp - delta[..., None]), 0.0) * scale  # masked: none
    ds = ds.astype(q.dtype)
    dq = jnp.einsum("bkgtc,bckh->btkgh", ds, k_j, preferred_element_type=_F32)
    dk_j = jnp.einsum("bkgtc,btkgh->bckh", ds, q, preferred_element_type=_F32)
    return dq, dk_j, dv_j


def softmax_delta(d_out, out):
    """``D_t = sum_h dO * O`` as ``(B, K, G, T)``: the softmax backward's row term."""
    return jnp.moveaxis(jnp.sum(d_out.astype(_F32) * out.astype(_F32), -1), 1, 3)

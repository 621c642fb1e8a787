"""Routers of a Mixture of Experts and their load-balance losses, as plain functions.

Shapes: N tokens, E experts, k experts per token. Everything here computes in float32:
the router's choices must not flip with the compute dtype's rounding.

- ``"softmax"`` (Mixtral, Qwen-MoE): ``p = softmax(logits)``, the k largest, their weights
  renormalised to sum to 1 (Mixtral's top-k then softmax over the k is the same); with
  ``renormalize=False`` the k probabilities as they are (Qwen-MoE's ``norm_topk_prob:
  false``: the weights sum to less than 1).
- ``"sigmoid"`` (DeepSeek-V3): ``s = sigmoid(logits)``, the k largest, weights ``s / sum(s)``
  over the chosen k.

Example:
    >>> import numpy as np
    >>> logits = np.array([[2.0, 1.0, 0.0, -1.0]], "float32")
    >>> weights, experts, probs = route(logits, 2, "softmax")
    >>> experts.tolist(), round(float(weights.sum()), 6)
    ([[0, 1]], 1.0)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kdist.parallel.experts import expert_counts  # noqa: F401  (the routers' counts)

ROUTERS = ("softmax", "sigmoid")


def route(logits, k: int, kind: str = "softmax", bias=None, renormalize: bool = True):
    """``logits (N, E)`` -> ``(weights (N, k), experts (N, k) int32, probs (N, E))``.

    ``probs`` is what the load-balance loss reads: the softmax, or the sigmoid scores
    normalised over the experts (DeepSeek-V3's sequence-wise balance loss does the same).
    Ties go to the lower expert id (``lax.top_k``). ``bias (E,)``: DeepSeek-V3's
    auxiliary-loss-free balance bias, added to the scores for the choice of the k only; the
    weights stay the unbiased scores' (the bias steers the load, not the output's mix).
    ``renormalize=False``: the chosen k scores are the weights as they are, not divided by
    their sum.

    Example:
        >>> import numpy as np
        >>> logits = np.array([[2.0, 1.0, 0.0]], "float32")
        >>> weights, experts, _ = route(logits, 1, "sigmoid", bias=np.array([0, 0, 5.0]))
        >>> experts.tolist(), weights.tolist()  # chosen by the bias, weighed without it
        ([[2]], [[1.0]])
        >>> weights, _, _ = route(np.zeros((1, 4), "float32"), 2, renormalize=False)
        >>> weights.tolist()  # two of four uniform probabilities, as they are
        [[0.25, 0.25]]
    """
    logits = jnp.asarray(logits, jnp.float32)
    if kind == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        scores = probs
    elif kind == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    else:
        raise ValueError(f"Unknown router {kind!r}; use one of {ROUTERS}.")
    if bias is None:
        chosen, experts = jax.lax.top_k(scores, k)  # (N, k) each
    else:
        _, experts = jax.lax.top_k(scores + jnp.asarray(bias, jnp.float32), k)  # (N, k)
        chosen = jnp.take_along_axis(scores, experts, axis=-1)  # (N, k) unbiased
    weights = chosen / jnp.sum(chosen, axis=-1, keepdims=True) if renormalize else chosen
    return weights, experts.astype(jnp.int32), probs


def load_balance_loss(probs, counts, batch=None):
    """The auxiliary load-balancing loss of Switch / Mixtral: ``E * sum_e f_e * P_e`` with
    ``f_e`` the share of tokens routed to expert ``e`` (count / N; over k choices it sums to
    k) and ``P_e`` the mean router probability of ``e``. Uniform routing gives ``k``; the
    gradient flows through ``P`` only (the counts are discrete). This is Hugging Face
    Mixtral's ``load_balancing_loss_func`` without padding masks. ``batch``: a sum over the
    devices whose tokens make up the batch (``probs`` is then this device's, ``counts`` the
    batch's); None: ``probs`` is the whole batch's.

    Example:
        >>> import numpy as np
        >>> probs = np.full((4, 2), 0.5, "float32")  # uniform over 2 experts, k=1
        >>> float(load_balance_loss(probs, np.array([2, 2])))
        1.0
    """
    num_tokens, num_experts = probs.shape
    if batch is not None:  # probs of this device's tokens, counts the batch's: sums first
        total = batch(jnp.sum(jnp.ones_like(probs[:, 0])))  # (typed as the tokens vary)
        mean = batch(jnp.sum(probs, axis=0)) / total  # (E,)
        return num_experts * jnp.sum(counts.astype(jnp.float32) / total * mean)
    share = counts.astype(jnp.float32) / num_tokens  # (E,)
    return num_experts * jnp.sum(share * jnp.mean(probs, axis=0))


def z_loss(logits, batch=None):
    """The router z-loss (ST-MoE, Zoph et al. 2022): ``mean(logsumexp(logits)^2)``, which
    keeps the router's logits small (float32 round-off in the softmax grows with them).

    Example:
        >>> import numpy as np
        >>> round(float(z_loss(np.zeros((3, 4), "float32"))), 5)  # log(4)^2
        1.92181
    """
    squares = jnp.square(jax.nn.logsumexp(jnp.asarray(logits, jnp.float32), axis=-1))
    if batch is not None:  # this device's tokens: the batch's mean from sums (as above)
        return batch(jnp.sum(squares)) / batch(jnp.sum(jnp.ones_like(squares)))
    return jnp.mean(squares)

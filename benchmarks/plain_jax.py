"""The reference a JAX user writes without kdist: the same Transformer as a kdist preset in
plain JAX (nanoGPT's shape of code), a jitted training step with its state donated.

GPT-2 (learned positions, LayerNorm, tanh-GELU MLP, biases) or Llama-style (RoPE, RMSNorm,
SwiGLU, grouped-query attention, no biases), tied output embedding, the same token table
as kdist's (padded rows never used as inputs, cut from the logits). Mixed precision as
Keras' ``mixed_bfloat16``: float32 weights and optimizer state, bfloat16 matmuls, norms
and the loss in float32. Attention is ``jax.nn.dot_product_attention(is_causal=True)``
with its default implementation (XLA's, on a TPU), no rematerialisation (``remat=True``:
each block under ``jax.checkpoint``, what a user adds when the step does not fit), optax
AdamW after global-norm clipping — the defaults of the ecosystem, nothing tuned.

Example:
    >>> config = dict(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
    ...               intermediate_dim=32, max_sequence_length=8)
    >>> params = init(config, 0)
    >>> forward(params, config, jnp.zeros((1, 8), "int32")).shape
    (1, 8, 64)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

_BF16 = jnp.bfloat16


def _defaults(config: dict) -> dict:
    c = dict(position_embedding="learned", norm="layer_norm", mlp_activation="gelu",
             use_bias=True, num_key_value_heads=None, vocabulary_divisible_by=1,
             rotary_max_wavelength=10000.0, layer_norm_epsilon=1e-5)
    c.update(config)
    c["kv_heads"] = c["num_key_value_heads"] or c["num_heads"]
    c["head_dim"] = c["hidden_dim"] // c["num_heads"]
    c["rows"] = -(-c["vocabulary_size"] // c["vocabulary_divisible_by"]) * \
        c["vocabulary_divisible_by"]
    return c


def init(config: dict, seed: int) -> dict:
    """Float32 parameters: normal(0.02) matrices, residual outputs scaled by 1/sqrt(2L)."""
    c = _defaults(config)
    d, f, n, k, h, layers = (c["hidden_dim"], c["intermediate_dim"], c["num_heads"],
                             c["kv_heads"], c["head_dim"], c["num_layers"])
    rng = np.random.default_rng(seed)

    def normal(*shape, std=0.02):
        return jnp.asarray(rng.normal(0, std, shape), jnp.float32)

    out_std = 0.02 / math.sqrt(2 * layers)
    block = {"wq": normal(layers, d, n * h), "wk": normal(layers, d, k * h),
             "wv": normal(layers, d, k * h), "wo": normal(layers, n * h, d, std=out_std),
             "up": normal(layers, d, f), "down": normal(layers, f, d, std=out_std),
             "norm1": jnp.ones((layers, d)), "norm2": jnp.ones((layers, d))}
    if c["mlp_activation"] == "swiglu":
        block["gate"] = normal(layers, d, f)
    if c["use_bias"]:
        for name, width in (("bq", n * h), ("bk", k * h), ("bv", k * h), ("bo", d),
                            ("bup", f), ("bdown", d)):
            block[name] = jnp.zeros((layers, width))
    if c["norm"] == "layer_norm":
        block["shift1"] = jnp.zeros((layers, d))
        block["shift2"] = jnp.zeros((layers, d))
    params = {"wte": normal(c["rows"], d), "blocks": block, "final_norm": jnp.ones(d)}
    if c["norm"] == "layer_norm":
        params["final_shift"] = jnp.zeros(d)
    if c["position_embedding"] == "learned":
        params["wpe"] = normal(c["max_sequence_length"], d)
    return params


def _norm(x, scale, shift, c):
    x = x.astype(jnp.float32)
    if c["norm"] == "layer_norm":
        mean = x.mean(-1, keepdims=True)
        x = (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True)
                                       + c["layer_norm_epsilon"])
        return (x * scale + shift).astype(_BF16)
    x = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + c["layer_norm_epsilon"])
    return (x * scale).astype(_BF16)


def _rope(x, wavelength):  # x (B, T, heads, H), rotate-half form
    half = x.shape[-1] // 2
    freq = wavelength ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freq  # (T, H/2)
    cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _dense(x, w, b=None):
    y = x @ w.astype(_BF16)
    return y if b is None else y + b.astype(_BF16)


def _block(x, p, c):
    """One pre-norm block: ``(B, T, D) -> (B, T, D)``."""
    bsz, t, _ = x.shape
    n, k, h = c["num_heads"], c["kv_heads"], c["head_dim"]
    y = _norm(x, p["norm1"], p.get("shift1"), c)
    q = _dense(y, p["wq"], p.get("bq")).reshape(bsz, t, n, h)
    kk = _dense(y, p["wk"], p.get("bk")).reshape(bsz, t, k, h)
    v = _dense(y, p["wv"], p.get("bv")).reshape(bsz, t, k, h)
    if c["position_embedding"] == "rotary":
        q, kk = _rope(q, c["rotary_max_wavelength"]), _rope(kk, c["rotary_max_wavelength"])
    a = jax.nn.dot_product_attention(q, kk, v, is_causal=True)  # (B, T, N, H)
    x = x + _dense(a.reshape(bsz, t, n * h), p["wo"], p.get("bo"))
    y = _norm(x, p["norm2"], p.get("shift2"), c)
    if c["mlp_activation"] == "swiglu":
        y = jax.nn.silu(_dense(y, p["gate"])) * _dense(y, p["up"])
    else:
        y = jax.nn.gelu(_dense(y, p["up"], p.get("bup")), approximate=True)
    return x + _dense(y, p["down"], p.get("bdown"))


def forward(params, config, tokens, remat: bool = False):
    """Float32 logits ``(B, T, V)`` of token ids ``(B, T)``; ``remat``: every block's
    activations recomputed in the backward pass (``jax.checkpoint``)."""
    c = _defaults(config)
    block = functools.partial(_block, c=c)
    block = jax.checkpoint(block) if remat else block
    x = params["wte"][tokens].astype(_BF16)
    if "wpe" in params:
        x = x + params["wpe"][: tokens.shape[1]].astype(_BF16)
    layers = c["num_layers"]
    for i in range(layers):  # unrolled, as a plain model is written
        x = block(x, jax.tree.map(lambda w, i=i: w[i], params["blocks"]))
    x = _norm(x, params["final_norm"], params.get("final_shift"), c)
    logits = (x @ params["wte"].astype(_BF16).T).astype(jnp.float32)
    return logits[..., : c["vocabulary_size"]]


def make_step(config: dict, learning_rate: float = 1e-4, remat: bool = False):
    """``(init_state(params), step(state, x, y) -> (state, loss))``, jitted and donated:
    optax AdamW (b2 0.95, weight decay 0.1) after clipping the global norm to 1; ``remat``
    as :func:`forward`'s."""
    import optax

    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=0.1))

    def loss_fn(params, x, y):
        logits = forward(params, config, x, remat)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(state, x, y):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return (lambda params: (params, optimizer.init(params)),
            jax.jit(step, donate_argnums=0))

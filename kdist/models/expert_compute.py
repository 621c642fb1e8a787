"""The experts' compute of a Mixture-of-Experts layer on one device (or under XLA's
partitioner): every assignment through its expert, dropless or into a capacity buffer.

Shapes: N tokens, D hidden, E experts, k experts per token, F each expert's width, A =
N x k assignments, C an expert's capacity. Dropless sorts the assignments by expert and
runs each expert's contiguous group through its weights: grouped matmuls
(``jax.lax.ragged_dot``) on accelerators, blocks of one expert's rows on a CPU and for
8-bit matmuls (:func:`blocked`). The capacity path fills a fixed ``(E, C, D)``
buffer, the shape the ``expert`` axis' all-to-all moves (:mod:`kdist.parallel.experts`).
:class:`kdist.models.moe.MoEFeedForward` chooses between them. ``kernels``: the experts'
stacked weights, ``(gate, up, down)`` (SwiGLU) or ``(up, down)`` (GELU)
(:func:`kdist.parallel.experts.expert_mlp`).

Example:
    >>> import numpy as np
    >>> tokens = np.ones((4, 8), "float32")
    >>> experts = np.array([[0, 1], [1, 0], [0, 1], [1, 0]], "int32")
    >>> w = [np.full(s, 0.1, "float32") for s in ((2, 8, 4), (2, 8, 4), (2, 4, 8))]
    >>> dropless(tokens, experts, expert_counts(experts, 2), w).shape
    (4, 2, 8)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kdist.parallel.experts import (
    capacity,
    dispatch_slots,
    expert_counts,  # noqa: F401 (the example's)
    expert_mlp,
    experts_batched,
    from_buffer,
    to_buffer,
)


def grouped(x, group_sizes, kernels):
    """Each group of rows of ``x (A, D)`` (sorted by expert; ``group_sizes (E,)``) through
    its expert (e.g. ``down_e(silu(x gate_e) * (x up_e))``) -> ``(A, D)``, grouped
    matmuls."""
    return expert_mlp(x, kernels, lambda a, w: jax.lax.ragged_dot(a, w, group_sizes))


def blocked(x, group_sizes, kernels, block: int = 128, precision: str = "bf16"):
    """:func:`grouped` by blocks of ``block`` rows of one expert each: every group
    padded with zero rows to a multiple of ``block`` (at most ``E x (block - 1)`` rows in
    all), each block through its expert's weights gathered for it (batched matmuls). Exact
    (padding rows are dropped); for XLA:CPU, which runs ``ragged_dot`` as a dense matmul
    over every expert with a mask (E x the FLOPs): measured 6.7x faster there, forward and
    backward, at the first gpt-nano-moe's shape (A 8192, D 256, F 336, E 8). Under an 8-bit
    ``precision`` each block's products are quantized
    (:func:`kdist.parallel.experts.batched_matmul`): its weight gradient scaled over the
    block's rows."""
    a, d = x.shape
    e = group_sizes.size
    block = max(1, min(block, a // e))
    padded = (group_sizes + block - 1) // block * block  # (E,)
    ends = jnp.cumsum(padded)
    expert = jnp.repeat(jnp.arange(e), group_sizes, total_repeat_length=a)  # (A,) row's
    start = jnp.cumsum(group_sizes) - group_sizes
    row = (ends - padded)[expert] + jnp.arange(a) - start[expert]  # (A,) padded position
    blocks = -(-(a + e * (block - 1)) // block)  # static: enough for any group sizes
    xb = jnp.zeros((blocks * block, d), x.dtype).at[row].set(x).reshape(blocks, block, d)
    # (blocks,) expert of each block: how many groups end at or before its first row
    # (unused blocks: any). A comparison, not jnp.searchsorted, whose shape inference
    # fails inside a shard_map region (a DiLoCo group's; JAX 0.10).
    owner = jnp.minimum(jnp.sum(ends[None, :] <= (jnp.arange(blocks) * block)[:, None],
                                axis=1), e - 1)
    h = experts_batched(xb, [w[owner] for w in kernels], precision)  # (blocks, b, D)
    return h.reshape(-1, d)[row]  # (A, D)


def dropless(tokens, experts, counts, kernels, precision: str = "bf16"):
    """``tokens (N, D)``, ``experts (N, k)`` -> every assignment's expert output
    ``(N, k, D)``: assignments sorted by expert, grouped matmuls (``ragged_dot``; blocks on
    a CPU, :func:`blocked`), unsorted."""
    n, k = experts.shape
    order = jnp.argsort(experts.reshape(-1), stable=True)  # (A,): grouped by expert
    # Blocks on a CPU, and for 8-bit matmuls (no quantized ragged_dot); not for Keras'
    # symbolic shape inference.
    if isinstance(n, int) and (jax.default_backend() == "cpu" or precision != "bf16"):
        sorted_out = blocked(tokens[order // k], counts, kernels, precision=precision)  # (A, D)
    else:
        sorted_out = grouped(tokens[order // k], counts, kernels)
    return sorted_out[jnp.argsort(order)].reshape(n, k, -1)  # back to token order


def capacity_limited(tokens, experts, counts, kernels, factor: float,
                     precision: str = "bf16"):
    """The capacity path: ``(N, k, D)`` expert outputs (zeros where dropped) and the
    number of dropped assignments."""
    n, k = experts.shape
    slots = capacity(n * k, counts.size, factor)
    slot = dispatch_slots(experts, counts, slots)
    out = experts_batched(to_buffer(tokens, slot, k, counts.size, slots), kernels, precision)
    return from_buffer(out, slot, k), jnp.sum(slot == counts.size * slots)

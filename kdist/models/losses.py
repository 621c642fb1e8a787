"""Fused, chunked cross-entropy of a language model's output projection.

The plain path computes logits ``(B, T, V)`` in float32 (for GPT-2 small at 8 x 1024 tokens
that is 1.6 GB, and as much again for their gradient) and then the loss. This module
computes the same mean cross-entropy **and its gradients** chunk by chunk over the sequence:
each chunk's ``(B, Tc, V)`` logits live only inside one iteration of a ``lax.scan``, so the
full logits never exist. Why chunks of positions and not of the vocabulary: a chunk of
positions holds complete rows, so its softmax is exact on its own and the gradients
(``softmax - onehot``) can be formed in the same pass; a vocabulary chunk would need the
global log-sum-exp first, i.e. a second matmul pass (one more ``2 * D * V`` per token).

The gradients are computed in the forward pass and kept as the residuals of a
``jax.custom_vjp`` (the backward pass only scales them), so the matmul FLOPs equal
autodiff's: logits, gradient of the hidden states, gradient of the table — no recompute.

Sharded meshes: under a kdist distribution the function runs in ``jax.shard_map``. The batch
is split over ``data`` x ``fsdp`` (and the tokens over ``seq``, context parallelism: the
loss and the table's gradient are then summed over it too); the table's vocabulary rows
are split over ``model`` (Megatron's vocab-parallel cross-entropy: the max and the sum of
the softmax and the target logit are reduced over ``model``, ``B x Tc`` numbers per
chunk); the table's ``fsdp`` sharding is gathered on entry like any FSDP weight, and its
gradient is reduce-scattered back over ``fsdp`` and summed over ``data``.

``matmul_precision`` quantizes the head's three matmuls (``GPTCausalLM``'s
``head_matmul_precision``) chunk by chunk inside the same VJP, so memory stays chunked;
which axes each product's scales reduce over is :func:`_head_products`'.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import keras
from jax.sharding import PartitionSpec as P

from kdist.parallel.region import to_varying, varying_axes
from kdist.precision import matmul as quantized
from kdist.precision.policy import check as check_precision


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _head_products(precision: str, model_axis, token_axes):
    """The head's three matmuls of one chunk, each accumulated and returned in float32:
    ``logits(h (b, Tc, D), table (v, D)) -> (b, Tc, v)``, ``grad_h(g (b, Tc, v), table) ->
    (b, Tc, D)`` and ``grad_table(g, h) -> (v, D)``. ``"bf16"``: plain einsums in the
    compute dtype. Quantized: :func:`kdist.precision.matmul.product` with the precision's
    quantizers and its matmul's scaling rules (per token / per output channel, each scale a
    maximum over the contracted axis), so ``"int8"`` computes what ``int8_matmul`` of
    ``hidden @ table.T`` and its backward would on the chunk. Each device quantizes its own
    shard's products; where the contracted axis is split across devices, the scales'
    maxima are reduced over those mesh axes as well (``pmax``), so they are one device's:
    the logits contract D, whole on every device (no reduction); ``grad_h`` contracts the
    vocabulary, split over ``model_axis`` (``g``'s per-token and the table's per-channel
    maxima ``pmax``-ed over it: ``b x Tc + D`` numbers a chunk); ``grad_table`` contracts
    the chunk's tokens, split over ``token_axes`` (the batch's axes and ``seq``: ``v + D``
    numbers). Its scales are a chunk's tokens', not the batch's: the chunk size changes
    the table's gradient by int8 rounding (as microbatches do), never the forward."""
    f32 = jnp.float32
    if precision == "bf16":
        return (lambda h, t: jnp.einsum("btd,vd->btv", h, t, preferred_element_type=f32),
                lambda g, t: jnp.einsum("btv,vd->btd", g, t, preferred_element_type=f32),
                lambda g, h: jnp.einsum("btv,btd->vd", g, h, preferred_element_type=f32))
    q = quantized.quantizers(precision)

    def over(quantizer, axes):
        return functools.partial(quantizer, axis_names=axes) if axes else quantizer

    vocab = (model_axis,) if model_axis else ()
    return (lambda h, t: quantized.product(h, t, (2,), (1,), q.x, q.w, q.accumulate),
            lambda g, t: quantized.product(g, t, (2,), (0,), over(q.dy, vocab),
                                           over(q.w, vocab), q.accumulate),
            # (D, v) then transposed: int8_matmul's dw = x^T . dy, its rescale's order.
            lambda g, h: quantized.product(h, g, (0, 1), (0, 1), over(q.x, token_axes),
                                           over(q.dy, token_axes), q.accumulate).T)


def _local_loss_and_grads(hidden, table, labels, num_chunks, total_tokens, model_axis,
                          replica_axes, fsdp_axis, with_grads, vocabulary_size, seq_axes=(),
                          matmul_precision="bf16"):
    """One device's part: ``hidden (b, T, D)``, ``table (v, D)`` (v = its vocabulary rows),
    ``labels (b, T)`` (T: its tokens, when ``seq_axes`` split the sequence). Returns the
    global mean loss and, if asked, the gradients. Table rows from ``vocabulary_size`` on
    are padding: their logits are left out of the softmax. ``matmul_precision``: the head's
    matmuls (:func:`_head_products`); the softmax and the loss stay float32."""
    b, t, d = hidden.shape
    v = table.shape[0]
    tc = t // num_chunks
    table = table.astype(hidden.dtype)  # the compute dtype, as the plain path's matmul
    offset = jax.lax.axis_index(model_axis) * v if model_axis else 0
    padding = (offset + jnp.arange(v)) >= vocabulary_size  # (v,) rows that are no token
    # (b, T, D) -> (C, b, Tc, D): the scan runs over chunks of positions.
    h_chunks = hidden.reshape(b, num_chunks, tc, d).swapaxes(0, 1)
    y_chunks = labels.astype(jnp.int32).reshape(b, num_chunks, tc).swapaxes(0, 1) - offset

    def reduce_model(x, op):
        return op(x, model_axis) if model_axis else x

    head_logits, head_grad_h, head_grad_table = _head_products(
        matmul_precision, model_axis, replica_axes + seq_axes)

    def body(carry, chunk):
        loss_sum, grad_table = carry
        h, y = chunk  # (b, Tc, D), (b, Tc) local vocabulary ids (out of range: other shard)
        logits = head_logits(h, table)  # (b, Tc, v) float32
        # A finite floor, not -inf: exp() gives 0 and 0 x floor stays 0 in the target sum.
        logits = jnp.where(padding, jnp.finfo(jnp.float32).min, logits)
        row_max = reduce_model(jax.lax.stop_gradient(logits.max(-1)), jax.lax.pmax)  # (b, Tc)
        exp = jnp.exp(logits - row_max[..., None])
        lse = row_max + jnp.log(reduce_model(exp.sum(-1), jax.lax.psum))  # (b, Tc)
        onehot = jax.nn.one_hot(y, v, dtype=jnp.float32)  # zero rows for other shards' ids
        target = reduce_model((logits * onehot).sum(-1), jax.lax.psum)  # (b, Tc)
        loss_sum = loss_sum + (lse - target).sum()
        if not with_grads:
            return (loss_sum, grad_table), None
        # d(mean loss)/d(logits) = (softmax - onehot) / tokens, in the compute dtype.
        g = ((exp / jnp.exp(lse - row_max)[..., None] - onehot) / total_tokens)
        g = g.astype(hidden.dtype)  # (b, Tc, v)
        grad_h = head_grad_h(g, table)
        grad_table = grad_table + head_grad_table(g, h)
        return (loss_sum, grad_table), grad_h

    init = (jnp.zeros((), jnp.float32),
            jnp.zeros((v, d), jnp.float32) if with_grads else jnp.zeros((), jnp.float32))
    # Inside shard_map (this one's or kdist.parallel.reduction's) the carries vary per device like
    # the chunks they sum (vma types): the loss like the rows, the table's gradient like
    # the rows and the table.
    rows = varying_axes(hidden) | varying_axes(labels)
    init = (to_varying(init[0], rows), to_varying(init[1], rows | varying_axes(table)))
    (loss_sum, grad_table), grad_h = jax.lax.scan(body, init, (h_chunks, y_chunks))
    if replica_axes + seq_axes:
        loss_sum = jax.lax.psum(loss_sum, replica_axes + seq_axes)
    loss = loss_sum / total_tokens
    if not with_grads:
        return loss
    grad_h = grad_h.swapaxes(0, 1).reshape(b, t, d)  # (b, T, D), partial over model
    grad_h = reduce_model(grad_h, jax.lax.psum)
    data_axes = tuple(a for a in replica_axes if a != fsdp_axis) + seq_axes
    if data_axes:
        grad_table = jax.lax.psum(grad_table, data_axes)
    if fsdp_axis:  # the table's embed dimension is fsdp-sharded: reduce-scatter into it
        grad_table = jax.lax.psum_scatter(grad_table, fsdp_axis, scatter_dimension=1,
                                          tiled=True)
    return loss, grad_h.astype(hidden.dtype), grad_table


def _run(hidden, table, labels, num_chunks, mesh_axes, vocabulary_size, with_grads,
         matmul_precision):
    """Runs the local computation, in ``shard_map`` when ``mesh_axes`` is given."""
    total = hidden.shape[0] * hidden.shape[1]
    if mesh_axes is None:
        return _local_loss_and_grads(hidden, table, labels, num_chunks, total, None, (), None,
                                     with_grads, vocabulary_size,
                                     matmul_precision=matmul_precision)
    mesh, replica_axes, model_axis, fsdp_axis, seq_axis = mesh_axes
    seq_axes = (seq_axis,) if seq_axis else ()
    fn = functools.partial(_local_loss_and_grads, num_chunks=num_chunks, total_tokens=total,
                           model_axis=model_axis, replica_axes=replica_axes,
                           fsdp_axis=fsdp_axis, with_grads=with_grads,
                           vocabulary_size=vocabulary_size, seq_axes=seq_axes,
                           matmul_precision=matmul_precision)
    batch = P(replica_axes or None, seq_axis, None)  # a split sequence: tokens over seq
    in_specs = (batch, P(model_axis, None), P(replica_axes or None, seq_axis))
    out_specs = (P(), batch, P(model_axis, fsdp_axis)) if with_grads else P()
    from kdist.parallel import region

    return region.shard_map(fn, mesh=mesh, axes=mesh.axis_names, in_specs=in_specs,
                            out_specs=out_specs)(hidden, table, labels)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fused_cross_entropy(hidden, table, labels, num_chunks, mesh_axes, vocabulary_size,
                         matmul_precision):
    return _run(hidden, table, labels, num_chunks, mesh_axes, vocabulary_size,
                with_grads=False, matmul_precision=matmul_precision)


def _fwd(hidden, table, labels, num_chunks, mesh_axes, vocabulary_size, matmul_precision):
    loss, grad_h, grad_table = _run(hidden, table, labels, num_chunks, mesh_axes,
                                    vocabulary_size, with_grads=True,
                                    matmul_precision=matmul_precision)
    return loss, (grad_h, grad_table)


def _bwd(num_chunks, mesh_axes, vocabulary_size, matmul_precision, residuals, g):
    grad_h, grad_table = residuals
    return (grad_h * g.astype(grad_h.dtype), (grad_table * g).astype(grad_table.dtype), None)


_fused_cross_entropy.defvjp(_fwd, _bwd)


def _mesh_axes(batch: int, vocabulary: int, hidden_dim: int, length: int | None = None):
    """(jax mesh, replica axes, model axis, fsdp axis, seq axis or None) of the active kdist
    distribution, or None when there is none (one device)."""
    from kdist.parallel import region
    from kdist.parallel.layout import active
    from kdist.parallel.mesh import batch_axes, summed_axes

    dist = active()
    if dist is None:
        return None  # one device
    manual = region.current().manual
    shape = dist.mesh_shape
    if all(a in manual for a, n in shape.items() if n > 1):
        return None  # every axis already manual: per device
    if manual and {*batch_axes(shape), *summed_axes(shape)} <= manual:  # rows and tokens
        return None  # already per device (kdist.parallel.reduction): model left to XLA
    # In a replica group's region (kdist.groups.diloco) the others axes are its own.
    replicas = batch_axes(shape, region.current().automatic(shape))
    model = dist.mesh_axis_for("vocab")  # the table's vocabulary axis: model (or stage)
    if model == "stage" and vocabulary % shape["stage"]:
        model = None  # the layout's fallback does not apply: the table is replicated
    fsdp = "fsdp" if shape["fsdp"] > 1 else None
    rows = math.prod(shape[a] for a in replicas)
    if batch % rows or vocabulary % shape[model or "model"] or (
            fsdp and hidden_dim % shape["fsdp"]):
        raise ValueError(
            f"Fused cross-entropy on mesh {dist.spec}: the batch ({batch}) must divide by "
            f"{' x '.join(replicas) or 'one device'} ({rows}), the vocabulary ({vocabulary}) "
            f"by {model or 'model'} ({shape[model or 'model']}) and the hidden size "
            f"({hidden_dim}) by fsdp ({shape['fsdp']}). Change the batch or the mesh, or build "
            f"the model with loss_chunk_size=None."
        )
    seq = "seq" if shape.get("seq", 1) > 1 and length and length % shape["seq"] == 0 else None
    return dist.device_mesh.backend_mesh, replicas, model, fsdp, seq


def _seq_size() -> int:
    from kdist.parallel.layout import current_mesh_shape

    return current_mesh_shape().get("seq", 1)


# "auto" (GPTCausalLM's default loss_chunk_size): the fused loss where it was measured faster,
# in one quiet run on 1 device, float32, CPU (benchmarks/defaults.py, benchmarks/README.md):
# GPT-2's vocabulary (50257), 2 x 1024 (392 MiB of logits), chunks of 128: 1.045x [1.032,
# 1.045] the logits path, 1.11x keras-hub; gpt2-small's vocabulary at 8 x 128 (196 MiB),
# chunks of 32: 1.12x [1.03, 1.25] (optimisations.py, under load). With gpt-nano's 8192
# entries it was slower at 16 x 256 (128 MiB) and 32 x 256 (256 MiB): 0.961x [0.957, 0.985]
# and 0.966x [0.960, 0.971] — so the vocabulary decides, not the logits' size alone. On an
# H200 it changed nothing (0.98-1.005x, the former gpu.py). Elsewhere "auto" keeps the logits.
AUTO_MIN_VOCABULARY = 32768
AUTO_MIN_LOGITS_BYTES = 64 * 2**20
AUTO_MAX_CHUNK_BYTES = 64 * 2**20
AUTO_MIN_CHUNKS = 4


def auto_chunk_size(batch, length, vocabulary_size: int, table_rows: int | None = None,
                    hidden_dim: int | None = None, platform: str | None = None) -> int | None:
    """The fused loss's chunk size that ``loss_chunk_size="auto"`` picks, or None (logits).

    The fused loss on a CPU when the vocabulary has at least :data:`AUTO_MIN_VOCABULARY`
    entries and the step's float32 logits ``batch x length x vocabulary_size x 4`` bytes
    are at least :data:`AUTO_MIN_LOGITS_BYTES`; chunks of the largest
    divisor of ``length`` giving at least :data:`AUTO_MIN_CHUNKS` chunks of at most
    :data:`AUTO_MAX_CHUNK_BYTES` logits. None on GPU/TPU (no gain measured), for smaller
    vocabularies or logits (measured slower, see above), for shapes not known
    when tracing, and where the fused loss cannot run sharded on the active mesh (see
    :func:`chunked_cross_entropy`). ``batch`` is the batch being traced (inside
    :mod:`kdist.parallel.reduction`'s per-device region: one device's rows).

    Example:
        >>> auto_chunk_size(2, 1024, 50257, platform="cpu"), auto_chunk_size(16, 256, 8192)
        (128, None)
    """
    if not all(isinstance(n, int) and n > 0 for n in (batch, length, vocabulary_size)):
        return None
    from kdist import accelerators
    from kdist.parallel import region
    from kdist.parallel.layout import current_mesh_shape

    platform = platform or accelerators.target().platform  # the device compiled for

    shape = current_mesh_shape()
    # The whole step's rows (tokens: a device holds 1/seq of each row's under context
    # parallelism).
    scope = region.current()
    rows = batch * math.prod(shape[a] for a in scope.batch_axes) * (
        _seq_size() if scope.tokens_split else 1)
    per_position = 4 * rows * vocabulary_size
    if platform != "cpu" or vocabulary_size < AUTO_MIN_VOCABULARY \
            or per_position * length < AUTO_MIN_LOGITS_BYTES:
        return None
    try:
        if hidden_dim is not None:
            _mesh_axes(batch, table_rows or vocabulary_size, hidden_dim)
    except ValueError:
        return None  # the batch or the table does not fit the mesh: logits
    limit = max(1, min(length // AUTO_MIN_CHUNKS, AUTO_MAX_CHUNK_BYTES // per_position))
    return _largest_divisor_at_most(length, limit)


def chunked_cross_entropy(hidden, table, labels, chunk_size: int = 128,
                          vocabulary_size: int | None = None, matmul_precision: str = "bf16"):
    """Mean next-token cross-entropy of ``hidden @ table.T`` without materialising the logits.

    Args:
        hidden: final hidden states ``(B, T, D)``, in the compute dtype (bf16 under
            ``mixed_bfloat16``: the matmuls run in it, accumulating in float32).
        table: output projection ``(V, D)`` — a tied embedding table; pass
            ``reverse_embeddings.T`` for an untied one.
        labels: target ids ``(B, T)``.
        chunk_size: positions per chunk; the largest divisor of ``T`` not above it is used.
            Peak logits memory is ``B x chunk_size x V`` float32 per chunk instead of
            ``B x T x V``.
        vocabulary_size: the ids in use when the table has padding rows beyond them
            (``GPTBackbone(vocabulary_divisible_by=...)``); those rows take no part in the
            softmax and get zero gradient. None: every row is a token.
        matmul_precision: the head's matmuls (``hidden @ table.T`` and both backward
            products): ``"bf16"`` (default: in the compute dtype) or a quantized
            precision of :mod:`kdist.precision` (``"int8"``, ``"int8-sr"``, ``"fp8"``),
            chunk by chunk inside the custom VJP; the softmax and the loss stay float32.

    Returns the float32 scalar ``mean(logsumexp(logits) - logits[label])``, equal to Keras'
    ``SparseCategoricalCrossentropy(from_logits=True)`` on the full logits; differentiable
    in ``hidden`` and ``table`` (a ``jax.custom_vjp``). Runs sharded under the active kdist
    distribution (see the module docstring).

    Example:
        >>> import numpy as np
        >>> h = np.ones((2, 8, 4), "float32"); w = np.ones((16, 4), "float32")
        >>> round(float(chunked_cross_entropy(h, w, np.zeros((2, 8), "int32"), 4)), 4)
        2.7726
    """
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int (positions per chunk); got "
                         f"{chunk_size!r}. Try 128.")
    hidden, table, labels = jnp.asarray(hidden), jnp.asarray(table), jnp.asarray(labels)
    if hidden.ndim != 3 or table.ndim != 2 or hidden.shape[-1] != table.shape[-1] or (
            labels.shape != hidden.shape[:2]):
        raise ValueError(
            f"Expected hidden (B, T, D), table (V, D) and labels (B, T); got shapes "
            f"{hidden.shape}, {table.shape}, {labels.shape}.")
    batch, length, dim = hidden.shape
    rows = table.shape[0]
    if vocabulary_size is None:
        vocabulary_size = rows
    if not isinstance(vocabulary_size, int) or not 0 < vocabulary_size <= rows:
        raise ValueError(f"vocabulary_size must be an int in [1, {rows}] (the table's rows); "
                         f"got {vocabulary_size!r}.")
    check_precision(matmul_precision)
    mesh_axes = _mesh_axes(batch, rows, dim, length)
    local = length // _seq_size() if mesh_axes and mesh_axes[4] else length  # per device
    num_chunks = local // _largest_divisor_at_most(local, chunk_size)
    return _fused_cross_entropy(hidden, table, labels, num_chunks, mesh_axes, vocabulary_size,
                                matmul_precision)


def is_default_loss(loss) -> bool:
    """None, or the loss compile() defaults to (as a reloaded model's compile config has it):
    the fused cross-entropy computes exactly that.

    Example:
        >>> is_default_loss(None)
        True
    """
    if loss is None:
        return True
    return (isinstance(loss, keras.losses.SparseCategoricalCrossentropy)
            and loss.get_config().get("from_logits") is True
            and loss.get_config().get("ignore_class") is None
            and loss.reduction == "sum_over_batch_size")

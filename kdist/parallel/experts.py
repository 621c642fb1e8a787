"""Expert parallelism's dispatch: tokens to their experts' devices and back with a
fixed-capacity ``all_to_all`` (the path XLA:CPU runs; ``ragged_all_to_all`` is not
implemented there).

Shapes on one device of a mesh axis of size P (the ``expert`` axis): n local tokens,
k experts per token, E experts in all and E/P of them local, C slots per expert and source
device. Each device packs its tokens into an ``(E, C, D)`` buffer
(:func:`dispatch_slots`, earlier tokens first), sends expert ``e``'s rows
to the device holding ``e`` (``all_to_all``: ``(P, E/P, C, D)`` in, the same out, indexed by
source), runs its E/P experts over the ``P x C`` rows each received, and sends the outputs
back the same way. With ``slots = n x k`` no assignment can overflow, and the result is the
dropless layer's (tested); fewer slots drop the late assignments and count them.

Under a distribution with an ``expert`` axis, :class:`kdist.models.moe.MoEFeedForward`
routes every token first (XLA's partitioner: the router, its losses and the load see the
whole batch, as on one device), then :func:`dispatch` runs only the experts' compute here,
in a ``shard_map`` manual over the batch's axes (``expert`` among them) and ``seq``, so the
activations enter as they lie (``model`` is left to XLA); nested in a DiLoCo group's
region, over those still automatic there (the group's rows). In a region manual over
``expert`` already (a pipeline's stage, kdist's per-device loss) each device's experts
arrive placed in zeros of the whole weight's shape (:func:`as_whole`, for Keras) and the
dispatch takes them back out. A dropless
layer gets ``slots = n x k`` (nothing can overflow: exact, at E x the buffer memory of a
tuned capacity); a ``capacity_factor`` gets ``ceil(factor x n x k / E)`` per source device.
:data:`TRANSFORM` is the axis's entry in the step: it refuses a model without experts.

Example:
    >>> out, dropped = expert_parallel_outputs(tokens, experts, (gate, up, down), mesh,
    ...                                        "expert", slots=16)  # doctest: +SKIP
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kdist import _keras_compat
from kdist.parallel import region
from kdist.parallel.layout import active
from kdist.parallel.mesh import batch_axes
from kdist.parallel.transform import Transform
from kdist.precision import matmul as quantized


def expert_counts(experts, num_experts: int):
    """How many of the ``(N, k)`` assignments went to each expert: ``(E,)`` int32."""
    return jnp.zeros((num_experts,), jnp.int32).at[experts.reshape(-1)].add(1)


def capacity(num_assignments: int, num_experts: int, factor: float) -> int:
    """Assignments an expert takes on the capacity path: ``ceil(factor x A / E)``.

    Example:
        >>> capacity(64, 8, 1.25)
        10
    """
    return max(1, math.ceil(factor * num_assignments / num_experts))


def batched_matmul(x, w, precision: str = "bf16"):
    """``x (n, c, d) @ w (n, d, f) -> (n, c, f)``: n independent products (one per expert,
    or per block of one expert's rows), each quantized under an 8-bit ``precision`` as a
    projection is (:func:`kdist.precision.matmul.matmul`: scales per row of ``x`` and per
    output channel of its ``w``, both backward products quantized too).

    Example:
        >>> batched_matmul(jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5)), "int8").shape
        (2, 3, 5)
    """
    if precision == "bf16":
        return jnp.einsum("ncd,ndf->ncf", x, w)
    # (In a shard_map both operands must vary over the same axes: the quantized matmul's
    # custom VJP returns each cotangent with its operand's type. The experts' region
    # types its weights so.)
    return jax.vmap(lambda a, b: quantized.matmul(a, b, 1, precision))(x, w)


def expert_mlp(x, kernels, matmul):
    """The experts' MLP, with ``matmul(x, w)`` the product of each (stacked) kernel:
    ``(gate, up, down)``: SwiGLU, ``down(silu(x gate) * (x up))`` (Mixtral, Qwen,
    DeepSeek); ``(up, down)``: GELU, ``down(gelu(x up))`` (GPT-2's tanh form: the
    Switch Transformer's experts, a GPT block's MLP without biases).

    Example:
        >>> w = jnp.full((4, 2), 0.5)
        >>> expert_mlp(jnp.ones((1, 4)), (w, w.T), jnp.matmul).shape  # GELU: (up, down)
        (1, 4)
    """
    if len(kernels) == 3:
        gate, up, down = kernels
        h = jax.nn.silu(matmul(x, gate)) * matmul(x, up)
    else:
        up, down = kernels
        h = jax.nn.gelu(matmul(x, up), approximate=True)
    return matmul(h, down)


def experts_batched(x, kernels, precision: str = "bf16"):
    """``x (E, C, D)``: each expert's buffer through its own weights (``kernels``:
    :func:`expert_mlp`'s, stacked ``(E, ...)``) -> ``(E, C, D)``."""
    return expert_mlp(x, kernels, lambda a, w: batched_matmul(a, w, precision))


def dispatch_slots(experts, counts, slots: int):
    """Where each assignment goes in an ``(E x slots)`` buffer: ``experts (N, k)`` ->
    ``(A,)`` int32 slot ``e x slots + position`` (position: its rank among its expert's
    assignments, earlier tokens first), ``E x slots`` for one past capacity (dropped)."""
    flat = experts.reshape(-1)  # (A,) token-major: token n's choices at n*k ... n*k+k-1
    order = jnp.argsort(flat, stable=True)
    starts = jnp.cumsum(counts) - counts  # (E,): first sorted index of each expert
    rank = jnp.zeros_like(flat).at[order].set(jnp.arange(flat.size, dtype=flat.dtype)
                                              - starts[flat[order]])
    return jnp.where(rank < slots, flat * slots + rank, counts.size * slots)


def to_buffer(tokens, slot, k: int, num_experts: int, slots: int):
    """``tokens (N, D)`` into the ``(E, slots, D)`` dispatch buffer (dropped: nowhere)."""
    d = tokens.shape[-1]
    buffer = jnp.zeros((num_experts * slots + 1, d), tokens.dtype)  # last row: the dropped
    buffer = buffer.at[slot].set(jnp.repeat(tokens, k, axis=0))
    return buffer[:-1].reshape(num_experts, slots, d)


def from_buffer(buffer, slot, k: int):
    """``(E, slots, D)`` outputs back to ``(N, k, D)`` per assignment (dropped: zeros)."""
    d = buffer.shape[-1]
    rows = jnp.concatenate([buffer.reshape(-1, d), jnp.zeros((1, d), buffer.dtype)])
    return rows[slot].reshape(-1, k, d)


def _exchange(buffer, axis: str, devices: int):
    """``(E, C, D)`` by destination expert -> ``(E/P, P x C, D)`` of this device's experts
    (rows grouped by source device); its own inverse with :func:`_return`."""
    e, c, d = buffer.shape
    received = jax.lax.all_to_all(buffer.reshape(devices, e // devices, c, d), axis, 0, 0,
                                  tiled=True)  # (P source, E/P, C, D)
    return received.transpose(1, 0, 2, 3).reshape(e // devices, devices * c, d)


def _return(outputs, axis: str, devices: int):
    """``(E/P, P x C, D)`` back to the ``(E, C, D)`` buffer of the tokens' device."""
    local, rows, d = outputs.shape
    c = rows // devices
    sent = outputs.reshape(local, devices, c, d).transpose(1, 0, 2, 3)  # (P dest, E/P, C, D)
    back = jax.lax.all_to_all(sent, axis, 0, 0, tiled=True)  # (P, E/P, C, D) by expert
    return back.reshape(devices * local, c, d)


def expert_parallel_outputs(tokens, experts, kernels, mesh, axis: str, slots: int,
                            token_axes: tuple[str, ...] | None = None,
                            seq_axis: str | None = None, precision: str = "bf16"):
    """Every assignment's expert output ``(..., k, D)`` and the dropped count, with the
    expert weights ``(E, ...)`` split over mesh axis ``axis`` and tokens ``(..., D)`` and
    their experts ``(..., k)`` split over ``token_axes`` along their first axis (default
    ``(axis,)``; the batch's axes, in its layout's order, so that the rows enter as they
    lie) and over ``seq_axis`` along their second (``(B, T, D)`` tokens of sequences split
    over ``seq``). ``kernels``: the experts' stacked weights (:func:`expert_mlp`'s).
    ``slots``: C per expert and source device.

    The region is manual over ``token_axes`` (and ``seq_axis``), those of them still
    automatic where it is traced (:func:`kdist.parallel.region.shard_map`: in a DiLoCo
    group's region ``replica`` is manual already, and the rows are the group's): a
    weight's shards over the other batch axes (fsdp's) are gathered on the way in, as XLA
    gathers them for a matmul, and its gradient summed over them on the way out
    (``shard_map``'s transpose)."""
    devices, num_experts = mesh.shape[axis], kernels[0].shape[0]
    # in a pipeline's stage or kdist's per-device loss: this device's experts, in zeros
    whole = axis in region.current().manual
    if num_experts % devices:
        raise ValueError(f"{num_experts} experts cannot be split over the '{axis}' mesh axis "
                         f"of size {devices}: use a number of experts divisible by it, or a "
                         f"smaller '{axis}' axis.")
    automatic = region.current().automatic(mesh.axis_names)
    token_axes = tuple(a for a in (token_axes or (axis,)) if a in automatic)
    split_tokens = (seq_axis,) if seq_axis in automatic else ()  # the sequence's split
    k = experts.shape[-1]

    def local(tokens, experts, kernels):  # (b[, t], D), (b[, t], k): this device's
        # Typed as varying with the rows before the cast: the gradient is summed over the
        # batch's axes (the cast's transpose) in the dtype the weights came in (float32
        # on a CPU: kdist.models.moe), and a quantized matmul's custom VJP gets operands
        # of one type.
        if whole:  # this device's experts, where as_whole put them
            start = jax.lax.axis_index(axis) * (num_experts // devices)
            kernels = [jax.lax.dynamic_slice_in_dim(w, start, num_experts // devices)
                       for w in kernels]
        kernels = [region.to_varying(w, region.varying_axes(tokens)).astype(tokens.dtype)
                   for w in kernels]
        leading = tokens.shape[:-1]
        tokens, experts = tokens.reshape(-1, tokens.shape[-1]), experts.reshape(-1, k)
        slot = dispatch_slots(experts, expert_counts(experts, num_experts), slots)  # (n k,)
        buffer = _exchange(to_buffer(tokens, slot, k, num_experts, slots), axis, devices)
        outputs = _return(experts_batched(buffer, kernels, precision), axis, devices)
        dropped = jax.lax.psum(jnp.sum(slot == num_experts * slots),
                               (*token_axes, *split_tokens))
        return from_buffer(outputs, slot, k).reshape(*leading, k, -1), dropped

    rows, split = P(token_axes, *split_tokens), P(None if whole else axis)
    return region.shard_map(local, mesh=mesh, axes={*token_axes, *split_tokens},
                            in_specs=(rows, rows, [split] * len(kernels)),
                            out_specs=(rows, P()), batch_axes=token_axes)(
        tokens, experts, list(kernels))


def as_whole(value, shape):
    """A weight ``value`` holding this device's experts (its ``expert`` dimension split
    over the ``expert`` mesh axis, manual here) placed in zeros of the weight's ``shape``;
    ``value`` itself where the shapes agree. Keras checks that a variable's value has its
    shape; the dispatch reads back the same experts (:func:`expert_parallel_outputs`), so
    nothing moves between devices, and the gradient of the padding is the device's own
    experts'. Used inside a pipeline's stage and kdist's per-device loss.

    Example:
        >>> as_whole(jnp.ones((2, 3)), (2, 3)).shape  # whole already
        (2, 3)
    """
    if tuple(value.shape) == tuple(shape):
        return value
    differ = [d for d, (a, b) in enumerate(zip(value.shape, shape)) if a != b]
    if (len(differ) != 1 or "expert" not in region.current().manual
            or shape[differ[0]] != value.shape[differ[0]] * jax.lax.axis_size("expert")):
        raise ValueError(f"A weight of shape {tuple(value.shape)} cannot stand for one of "
                         f"shape {tuple(shape)}: only an expert dimension split over a "
                         f"manual 'expert' axis is padded back.")
    d = differ[0]
    start = jax.lax.axis_index("expert") * value.shape[d]
    return jax.lax.dynamic_update_slice_in_dim(jnp.zeros(shape, value.dtype), value, start, d)


def dispatch(tokens, experts, kernels, capacity_factor: float | None,
             precision: str = "bf16"):
    """``(..., k, D)`` expert outputs and the dropped count over the active distribution's
    ``expert`` axis, or None when it has none or cannot split the rows over the batch's
    axes (the layer computes them all, XLA partitioning it as any op). ``tokens
    (..., D)`` and ``experts (..., k)`` keep the activations' leading axes, so that tokens
    of sequences split over ``seq`` enter the experts' region as they lie."""
    dist = active()
    if (dist is None or dist.mesh_shape.get("expert", 1) == 1
            or not all(isinstance(n, int) for n in experts.shape)):  # Keras inferring shapes
        return None
    sizes, here = dist.mesh_shape, region.current()
    token_axes = batch_axes(sizes, here.automatic(sizes))  # the rows' layout (expert among)
    seq = "seq" if (sizes.get("seq", 1) > 1 and "seq" not in here.manual
                    and experts.ndim == 3) else None  # (B, T, k): tokens split over seq too
    splits = math.prod(sizes[a] for a in token_axes)
    if experts.shape[0] % splits or (seq and experts.shape[1] % sizes[seq]):
        return None  # rows the axes do not split (decoding one sequence): XLA's, whole
    per_device = splits * (sizes[seq] if seq else 1)
    k = experts.shape[-1]
    n = math.prod(experts.shape[:-1]) // per_device  # tokens per device
    slots = n * k if capacity_factor is None else capacity(n * k, kernels[0].shape[0],
                                                            capacity_factor)
    return expert_parallel_outputs(tokens, experts, kernels,
                                   dist.device_mesh.backend_mesh, "expert", slots, token_axes,
                                   seq, precision)


def _has_experts(model) -> bool:
    layers = _keras_compat.all_layers(model)
    templates = [_keras_compat.all_layers(layer.block) for layer in layers  # scanned stacks'
                 if hasattr(layer, "stacked_state_of")]                     # one block each
    return any(hasattr(layer, "num_experts") for layer in sum(templates, layers))


def _prepare(dist, model) -> None:
    sizes = dist.mesh_shape
    if sizes.get("replica", 1) > 1 and sizes.get("fsdp", 1) > 1:
        # Each pair trains; all three abort XLA:CPU's partitioner (JAX 0.10: a CHECK in
        # spmd_partitioner_util.cc gathering the token embedding in a group's region).
        raise ValueError(
            f"Mesh {dist.spec} puts 'expert', 'fsdp' and 'replica' together, which XLA's "
            f"partitioner cannot compile (it aborts the process; each pair of them trains). "
            f"Put the fsdp devices on 'data' (e.g. 'replica=2,expert=2,data=2'), or drop "
            f"'replica'.")
    if not _has_experts(model):
        raise ValueError(
            f"Mesh {dist.spec} has an 'expert' axis of size {dist.mesh_shape['expert']}, but "
            f"{type(model).__name__} has no Mixture-of-Experts layer to split over it. Build "
            f"the model with experts (GPTBackbone(..., moe={{'num_experts': 8}}), or the "
            f"gpt-nano-moe preset), or put those devices on 'data' or 'fsdp'.")


def _refusal(dist, model) -> str:
    return (f"Mesh {dist.spec} has an 'expert' axis, which {type(model).__name__} does not "
            f"support (it does not declare the 'expert_parallel' step feature: it has no "
            f"Mixture-of-Experts layers). Put those devices on 'data' or 'fsdp'.")


# The 'expert' axis's entry in the step: refusals only (the dispatch runs in the layers).
TRANSFORM = Transform("experts", wanted=lambda dist: dist.mesh_shape.get("expert", 1) > 1,
                      feature="expert_parallel", refusal=_refusal, prepare=_prepare)

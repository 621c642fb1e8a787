"""Gradients reduced by kdist instead of XLA's partitioner: one collective per weight.

Under XLA's automatic partitioning (GSPMD) every op that produces a partial sum of a
gradient gets its own all-reduce, in that op's output type, and XLA:CPU turns none of them
into reduce-scatters (``benchmarks/README.md``, ``communication.py``): the tied token
table's two gradients are reduced separately, fsdp gradients are all-reduced in full and
then sliced, and everything is reduced in float32. With ``gradient_reduction`` set on the
distribution, the loss and its gradient are computed per device in a ``jax.shard_map``
over the ``data`` and ``fsdp`` axes, and each weight's gradient leaves it through one
``custom_vjp``: every use of the weight summed on the device first, then one
reduce-scatter over ``fsdp`` (into the device's shard) and one all-reduce over ``data`` of
that shard — the minimum traffic of data and fully sharded data parallelism — in float32
or, as an option, bfloat16 (half the bytes; each device's partial gradient is rounded to 8
bits of mantissa before the sum).

Scope: meshes without a ``model`` axis (tensor parallel meshes keep XLA's reduction) and
models without dropout (inside the manual region every device would draw the same dropout
mask for its rows); both are refused with the reason. The loss is each device's mean over
its rows, averaged over devices: Keras' mean over the global batch when every device holds
the same number of rows, which kdist's data layout guarantees.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kdist import _keras_compat
from kdist.parallel.constraints import manual_region, varying_axes
from kdist.parallel.context import step as context_step
from kdist.parallel.layout import active
from kdist.parallel.mesh import REPLICA_AXES

REDUCTIONS = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def check(dist, model) -> None:
    """Refuses a model that explicit reduction does not cover (dropout), saying why. The
    mesh (no ``model`` axis) is checked when the distribution is built."""
    rates = {layer.name: layer.rate for layer in _keras_compat.all_layers(model)
             if isinstance(getattr(layer, "rate", None), float) and layer.rate > 0}
    if rates:
        raise ValueError(
            f"gradient_reduction={dist.gradient_reduction!r} computes each device's rows in a "
            f"manual region where every device would draw the same dropout mask; this model "
            f"has dropout (layers {', '.join(sorted(rates)[:3])}). Train with dropout=0 or "
            f"gradient_reduction=None.")


def loss_and_updates(model, compute, trainable, non_trainable, metrics, x, y, sample_weight,
                     optimizer_variables):
    """Keras' ``compute_loss_and_updates(..., training=True)`` with kdist's reduction.

    ``compute`` is the model's own ``compute_loss_and_updates``; it runs per device on the
    device's rows and the gathered weights. Returns what it returns, with the loss averaged
    over devices; the gradient of that loss arrives reduced and sharded like the weights.
    """
    dist = active()
    reduce_dtype = REDUCTIONS[dist.gradient_reduction]
    sizes = dist.mesh_shape
    batch_axes = tuple(a for a in REPLICA_AXES if sizes[a] > 1)
    # A split sequence (kdist.parallel.context): each device holds its own tokens, so the
    # loss and every gradient are partial over `seq` too, and summed over it like a replica.
    summed = batch_axes + context_step.summed_axes()
    specs = [P(*dist.get_variable_layout(v).axes) for v in model.trainable_variables]
    fsdp_dims = [next((i for i, a in enumerate(s) if a == "fsdp"), None) for s in specs]

    def local(trainable, non_trainable, metrics, x, y, sample_weight, optimizer_variables):
        full = [_use(w, dim, summed, reduce_dtype)
                for w, dim in zip(trainable, fsdp_dims)]
        with manual_region():
            loss, (unscaled, y_pred, non_trainable, metrics) = compute(
                full, non_trainable, metrics, x, y, sample_weight, training=True,
                optimizer_variables=optimizer_variables)
        if summed:  # this device's mean over its rows (and tokens) -> the mean over all
            loss, unscaled = jax.lax.pmean((loss, unscaled), summed)
        return loss, (unscaled, y_pred, non_trainable, metrics)

    mesh = dist.device_mesh.backend_mesh
    rows = [jax.tree.map(lambda a: context_step.row_spec(a, batch_axes), t)
            for t in (x, y, sample_weight)]
    in_specs = (specs, P(), P(), *rows, P())
    out_specs = (P(), (P(), context_step.output_spec(batch_axes), P(), P()))
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(
        trainable, non_trainable, metrics, x, y, sample_weight, optimizer_variables)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _use(weight, fsdp_dim, batch_axes, reduce_dtype):
    """The full weight from this device's shard; its gradient is reduced on the way back.

    The result is typed as varying over every batch axis (it meets per-device rows), so
    JAX adds no reduction of its own: the backward pass below is the only one.
    """
    if fsdp_dim is not None:
        weight = jax.lax.all_gather(weight, "fsdp", axis=fsdp_dim, tiled=True)
    invariant = tuple(a for a in batch_axes if a not in varying_axes(weight))
    return jax.lax.pcast(weight, invariant, to="varying") if invariant else weight


def _use_fwd(weight, fsdp_dim, batch_axes, reduce_dtype):
    return _use(weight, fsdp_dim, batch_axes, reduce_dtype), None


def _use_bwd(fsdp_dim, batch_axes, reduce_dtype, _, grad):
    dtype = grad.dtype
    grad = grad.astype(reduce_dtype)  # the sum of every use of the weight on this device
    if fsdp_dim is not None:  # into this device's shard: a reduce-scatter
        grad = jax.lax.psum_scatter(grad, "fsdp", scatter_dimension=fsdp_dim, tiled=True)
    rest = tuple(a for a in batch_axes if a != "fsdp" or fsdp_dim is None)
    if rest:  # over the replicas that hold the same shard: an all-reduce
        grad = jax.lax.psum(grad, rest)
    return (grad.astype(dtype),)


_use.defvjp(_use_fwd, _use_bwd)

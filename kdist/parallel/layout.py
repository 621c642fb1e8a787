"""The Keras distribution: a checked layout for every weight and for the batch.

:func:`distribution` turns a mesh spec into a :class:`KdistDistribution` (a Keras
``ModelParallel``). Every weight's layout comes from its logical axes
(:mod:`kdist.parallel.rules`) and is checked when the variable is created — when the
model is built, before anything compiles: a large weight with no logical axes is an error
(no silent replication), and a sharded dimension must divide by its mesh axis. The batch is
split over every replica axis at once (``data`` and ``fsdp``); Keras' ``TensorLayout``
takes one mesh axis per dimension, so :class:`BatchLayout` accepts a tuple.

Everything else in kdist asks :func:`active` for the distribution in force.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence

import keras
import numpy as np
from keras.distribution import DeviceMesh, LayoutMap, ModelParallel, TensorLayout

from kdist import _keras_compat
from kdist.parallel import auto, rules
from kdist.parallel import stages as stages_lib
from kdist.parallel.mesh import MESH_AXES, REPLICA_AXES, device_grid, mesh_spec, parse_mesh

# Weights with at most this many elements may have no logical axes and are then
# replicated (seed-generator states, metric accumulators, scalar counters).
REPLICATE_BELOW = 4096

GRADIENT_REDUCTIONS = (None, "float32", "bfloat16", "float8", "int8")

# How attention crosses a sequence split over `seq` (kdist.parallel.context).
CONTEXT_PARALLEL = ("all_gather", "ring")


class BatchLayout(TensorLayout):
    """A ``TensorLayout`` whose dimensions may each be sharded over a tuple of mesh axes.

    Keras accepts one mesh axis name per dimension; JAX's ``PartitionSpec`` accepts a tuple.
    The batch dimension uses this to be split over ``("data", "fsdp")``.
    """

    def _validate_axes(self):
        if self._device_mesh:
            valid = set(self._device_mesh.axis_names)
            used = set()
            for axis in self._axes:
                used.update(axis if isinstance(axis, tuple) else (axis,))
            unknown = used - valid - {None}
            if unknown:
                raise ValueError(
                    f"Layout axes {sorted(unknown)} are not mesh axes {sorted(valid)}."
                )


class KdistDistribution(ModelParallel):
    """Keras ``ModelParallel`` with kdist's rules: logical axes in, checked layouts out.

    Build it with :func:`distribution`. ``layout_for(path, shape)`` returns the layout a
    weight of that path and shape gets; ``mesh_shape`` gives the axis sizes;
    ``gradient_reduction`` is the step feature it asks of the model (None: XLA reduces);
    ``context_parallel`` and ``load_balance`` how attention crosses a ``seq`` split.

    Example:
        >>> dist = distribution("data=2,model=4", jax.devices())
        >>> dist.mesh_shape["model"], dist.spec
        (4, 'data=2,model=4')
    """

    def __init__(self, device_mesh: DeviceMesh, auto_shard_dataset: bool = True,
                 auto_shard: bool = False, allow_replicated: Sequence[str] = (),
                 gradient_reduction: str | None = None, error_feedback: bool = False,
                 sync_every: int | None = None, outer_learning_rate: float = 0.7,
                 outer_momentum: float = 0.9, outer_nesterov: bool = True,
                 pipeline_microbatches: int | None = None, pipeline_repeats: int = 1,
                 context_parallel: str = "all_gather", load_balance: bool = True):
        # Before Keras' __init__, which reads num_model_replicas when there are several
        # processes.
        self.mesh_shape = dict(zip(device_mesh.axis_names, device_mesh.shape))
        self.gradient_reduction = gradient_reduction
        self.error_feedback = error_feedback
        # DiLoCo over the replica axis (kdist.parallel.replicas); None: no replica groups.
        self.sync_every = sync_every
        self.outer_learning_rate = outer_learning_rate
        self.outer_momentum = outer_momentum
        self.outer_nesterov = outer_nesterov
        # The stage axis' schedule (kdist.parallel.pipeline): microbatches per step and
        # circular repeats; checked by distribution().
        self.pipeline_microbatches = pipeline_microbatches
        self.pipeline_repeats = pipeline_repeats
        self.context_parallel = context_parallel
        self.load_balance = load_balance
        super().__init__(layout_map=LayoutMap(device_mesh), batch_dim_name="data",
                         auto_shard_dataset=auto_shard_dataset)
        # Weights without logical axes: kdist.parallel.auto (structure and shape).
        self.auto_shard = auto_shard
        self.allow_replicated = tuple(allow_replicated)

    @property
    def num_model_replicas(self) -> int:
        return math.prod(self.mesh_shape[a] for a in REPLICA_AXES)

    @property
    def spec(self) -> str:
        """The mesh as a spec string, e.g. ``'data=2,fsdp=2,model=2'``."""
        return mesh_spec(self.mesh_shape)

    def mesh_axis_for(self, logical_axis: str | None) -> str | None:
        """The mesh axis a logical axis is sharded over here, or None if replicated (its
        rule's axis, else its fallback's: ``rules.FALLBACK_MESH``)."""
        mesh_axis = rules.LOGICAL_TO_MESH.get(logical_axis)
        if mesh_axis is not None and self.mesh_shape[mesh_axis] == 1:
            mesh_axis = rules.FALLBACK_MESH.get(logical_axis)
        if mesh_axis is None or self.mesh_shape[mesh_axis] == 1:
            return None
        return mesh_axis

    def get_data_layout(self, data_shape):
        return BatchLayout((REPLICA_AXES,) + (None,) * (len(data_shape) - 1), self.device_mesh)

    def layout_for(self, path: str, shape: Sequence[int],
                   logical: Sequence[str | None] | None = None) -> TensorLayout:
        """The checked layout of a weight; raises ``ValueError`` with a fix if there is none.
        ``logical``: its logical axes (default: a registered table's, by ``path``)."""
        shape = tuple(shape)
        logical = rules.logical_axes_for(path) if logical is None else tuple(logical)
        if logical is None and self.auto_shard:
            axes, _ = auto.infer_axes(path, shape, self.mesh_shape,
                                      replicate_below=REPLICATE_BELOW,
                                      allow_replicated=self.allow_replicated)
            return TensorLayout(axes, self.device_mesh)
        if logical is None:
            size = math.prod(shape)
            if size > REPLICATE_BELOW:
                raise ValueError(
                    f"Weight '{path}' (shape {shape}, {size:,} elements) has no logical axes "
                    f"(its layer declares none and no registered table matches), so it would "
                    f"be silently replicated on every device. Declare them where the layer "
                    f"creates it (kdist.parallel.rules.add_weight / build_with_axes), register "
                    f"a table (kdist.parallel.rules.register_logical_axes), or shard it "
                    f"automatically: kdist.distribution(spec, auto_shard=True)."
                )
            return TensorLayout((None,) * len(shape), self.device_mesh)
        if len(logical) != len(shape):
            raise ValueError(
                f"Weight '{path}' has shape {shape} ({len(shape)} dims) but its declaration "
                f"names {len(logical)} logical axes {logical}. Fix the model's declaration."
            )
        axes = []
        for dim, (logical_axis, size) in enumerate(zip(logical, shape)):
            mesh_axis = self.mesh_axis_for(logical_axis)
            if mesh_axis is not None and size % self.mesh_shape[mesh_axis] and \
                    rules.FALLBACK_MESH.get(logical_axis) == mesh_axis:
                mesh_axis = None  # a fallback that does not divide: replicated, as without
            if mesh_axis is not None and size % self.mesh_shape[mesh_axis]:
                n = self.mesh_shape[mesh_axis]
                raise ValueError(
                    f"Weight '{path}' (shape {shape}) cannot be sharded: dimension {dim} "
                    f"('{logical_axis}', size {size}) does not divide by the '{mesh_axis}' mesh "
                    f"axis of size {n}. Use a '{mesh_axis}' size among {divisors(size)}, or "
                    f"change the model so that '{logical_axis}' is a multiple of {n}."
                )
            axes.append(mesh_axis)
        fsdp = self.mesh_shape["fsdp"]
        if fsdp > 1 and "fsdp" not in axes:
            # ZeRO-3 keeps 1/fsdp of every weight per device: one the rules leave unsharded
            # over fsdp (norm scales, biases, a bias's heads under pure fsdp) is split along
            # its largest free dimension that divides. It is all-gathered where it is used.
            free = [d for d, (a, n) in enumerate(zip(axes, shape)) if a is None and n % fsdp == 0]
            if free:
                axes[max(free, key=lambda d: shape[d])] = "fsdp"
        return TensorLayout(tuple(axes), self.device_mesh)

    def get_variable_layout(self, variable):
        given = _keras_compat.variable_layout(variable)
        if given is not None:
            return given
        return self.layout_for(variable.path, variable.shape, rules.declared_axes(variable))


def distribution(spec: str = "auto", devices: Sequence | None = None, *,
                 auto_shard_dataset: bool = False, auto_shard: bool = False,
                 allow_replicated: Sequence[str] = (),
                 gradient_reduction: str | None = None,
                 error_feedback: bool = False, sync_every: int | None = None,
                 outer_learning_rate: float = 0.7, outer_momentum: float = 0.9,
                 outer_nesterov: bool = True, pipeline_microbatches: int | None = None,
                 pipeline_repeats: int = 1, context_parallel: str = "all_gather",
                 load_balance: bool = True) -> KdistDistribution:
    """Builds the Keras distribution for a mesh spec over all (or the given) devices.

    Set it before building the model; ``compile`` and ``fit`` then run sharded. With several
    processes, kdist's datasets already yield each process's own share of the global batch
    (see :func:`process_batch_share`), so Keras' auto-sharding stays off; pass
    ``auto_shard_dataset=True`` to feed a global ``tf.data.Dataset`` instead, which Keras
    then splits by process. ``auto_shard=True`` shards weights without logical axes
    (keras-hub or your own model) by structure and shape (:mod:`kdist.parallel.auto`);
    ``allow_replicated`` lists path regexes of large weights that may stay replicated.
    ``gradient_reduction="float32"`` or ``"bfloat16"``: models that declare the
    ``"gradient_reduction"`` step feature reduce each weight's gradient themselves, once,
    as a reduce-scatter over ``fsdp`` and an all-reduce over ``data``, in that type
    (:mod:`kdist.parallel.reduction`); ``"float8"`` or ``"int8"`` exchange 8-bit codes with
    a scale per block and sum in float32 (:mod:`kdist.parallel.compression`), with
    ``error_feedback=True`` carrying each device's quantisation error to the next step (in
    the optimizer state); None leaves the reductions to XLA.

    ``sync_every=H`` trains the ``replica`` axis' groups with DiLoCo
    (:mod:`kdist.parallel.replicas`): each group (its own ``data``/``fsdp``/``model``
    sub-mesh) takes H steps of the compiled optimizer on its share of every batch without
    communicating, then the groups average their parameter change and an outer SGD
    (``outer_learning_rate``, ``outer_momentum``, ``outer_nesterov``; the paper's 0.7, 0.9,
    Nesterov) moves the shared weights. A ``replica`` axis needs ``sync_every``.

    ``pipeline_microbatches`` and ``pipeline_repeats`` shape the schedule of a ``stage``
    axis (``"stage=4,fsdp=2"``: :mod:`kdist.parallel.pipeline`): each replica group's batch
    is cut into that many microbatches (default: one per stage; at least one per stage),
    and each device holds ``pipeline_repeats`` non-adjacent stages (circular repeats: the
    bubble falls from ``(S-1)/(M+S-1)`` to ``(S-1)/(R M+S-1)``).

    A ``seq`` axis splits every sequence's tokens (context parallelism,
    :mod:`kdist.parallel.context`): ``context_parallel="all_gather"`` (default) gathers
    keys and values for each attention layer, ``"ring"`` passes them around the axis
    (``O(T / seq)`` memory); ``load_balance=True`` gives causal models' devices equal
    attention work (each holds two of ``2 x seq`` chunks; sequence lengths must divide by
    ``2 x seq``).

    Example:
        >>> import keras, kdist
        >>> keras.distribution.set_distribution(kdist.distribution("auto"))
    """
    if gradient_reduction not in GRADIENT_REDUCTIONS:
        raise ValueError(f"gradient_reduction must be None (XLA places the reductions), "
                         f"'float32', 'bfloat16', 'float8' or 'int8'; got "
                         f"{gradient_reduction!r}.")
    if not isinstance(error_feedback, bool):
        raise TypeError(f"error_feedback must be True or False; got {error_feedback!r}.")
    if error_feedback and gradient_reduction not in ("float8", "int8"):
        raise ValueError(
            f"error_feedback=True carries the error of 8-bit gradient codes to the next step; "
            f"it needs gradient_reduction='float8' or 'int8', got {gradient_reduction!r}.")
    if context_parallel not in CONTEXT_PARALLEL:
        raise ValueError(f"context_parallel must be one of {CONTEXT_PARALLEL} (how attention "
                         f"crosses a sequence split over 'seq'); got {context_parallel!r}.")
    if not isinstance(load_balance, bool):
        raise ValueError(f"load_balance must be True or False; got {load_balance!r}.")
    devices = list(devices) if devices is not None else keras.distribution.list_devices()
    try:
        sizes = parse_mesh(spec, len(devices))
    except ValueError as e:
        raise ValueError(_host_devices_hint(spec, devices) or str(e)) from None
    if sizes["seq"] > 1 and (sizes["stage"] > 1 or sizes["replica"] > 1):
        raise ValueError(
            f"Mesh spec {spec!r}: the 'seq' axis has not been built or tested together with "
            f"'stage' or 'replica'. Use seq with data, fsdp and model.")
    _check_replica_settings(spec, sizes, sync_every, outer_learning_rate, outer_momentum,
                            outer_nesterov)
    _check_untested_combinations(spec, sizes, gradient_reduction, sync_every)
    if sync_every is not None and "replica" not in _named_axes(spec):
        raise ValueError(
            f"sync_every={sync_every} trains replica groups with DiLoCo (the model's weights "
            f"then change only every {sync_every} steps), but mesh spec {spec!r} names no "
            f"'replica' axis. Name one: e.g. 'replica=2,fsdp=4' for two groups, or "
            f"'replica=1,...' for DiLoCo's outer step on a single group; or leave sync_every "
            f"out for plain training.")
    microbatches = _pipeline_settings(spec, sizes, gradient_reduction, pipeline_microbatches,
                                      pipeline_repeats)
    grid = device_grid(devices, sizes)
    mesh = DeviceMesh(shape=grid.shape, axis_names=MESH_AXES, devices=grid)
    return KdistDistribution(mesh, auto_shard_dataset=auto_shard_dataset,
                             auto_shard=auto_shard, allow_replicated=allow_replicated,
                             gradient_reduction=gradient_reduction,
                             error_feedback=error_feedback, sync_every=sync_every,
                             outer_learning_rate=outer_learning_rate,
                             outer_momentum=outer_momentum, outer_nesterov=outer_nesterov,
                             pipeline_microbatches=microbatches,
                             pipeline_repeats=pipeline_repeats,
                             context_parallel=context_parallel, load_balance=load_balance)


def _named_axes(spec: str) -> set[str]:
    return {part.partition("=")[0].strip().lower() for part in str(spec).split(",")}


def _host_devices_hint(spec, devices) -> str | None:
    """On a CPU with fewer devices than the spec's sizes need: the fix is
    ``kdist.force_host_devices`` (a CPU starts as one device), said in the message."""
    needed = math.prod(int(n) for n in re.findall(r"=\s*(\d+)", str(spec)))
    platform = getattr(devices[0], "platform", None) or str(devices[0]).partition(":")[0]
    if needed <= len(devices) or platform.lower() != "cpu":  # keras lists "cpu:0" strings
        return None
    return (f"Mesh spec {spec!r} needs {needed} devices, but JAX sees {len(devices)} CPU "
            f"device(s). On a CPU, present the cores as {needed} devices: call "
            f"kdist.force_host_devices({needed}) first thing in the script, before anything "
            f"uses JAX (the recipes' --host-devices {needed}); or use a mesh of "
            f"{len(devices)} device(s), e.g. 'auto'.")


def _check_untested_combinations(spec, sizes, gradient_reduction, sync_every):
    """DiLoCo and 8-bit gradients were built and tested without pipeline stages and
    context parallelism: refused with them rather than trained untested."""
    for axis, what in (("stage", "pipeline stages"), ("seq", "context parallelism")):
        if sizes[axis] > 1 and (sync_every or gradient_reduction in ("float8", "int8")):
            feature = (f"sync_every={sync_every} (DiLoCo)" if sync_every else
                       f"gradient_reduction={gradient_reduction!r}")
            raise ValueError(
                f"Mesh spec {spec!r}: {feature} is not built for a '{axis}' axis ({what}) "
                f"yet. Use a mesh without '{axis}', or leave {feature.split('=')[0]} unset.")


def _check_replica_settings(spec, sizes, sync_every, learning_rate, momentum, nesterov):
    if sync_every is None:
        if sizes["replica"] > 1:
            raise ValueError(
                f"Mesh spec {spec!r} has a replica axis of {sizes['replica']}: replica groups "
                f"synchronise every few steps (DiLoCo) and need sync_every=H, e.g. "
                f"kdist.distribution({spec!r}, sync_every=50). For synchronous data "
                f"parallelism put those devices on 'data'.")
        return
    if isinstance(sync_every, bool) or not isinstance(sync_every, numbers.Integral) \
            or sync_every < 1:
        raise ValueError(f"sync_every must be a positive integer (inner steps between "
                         f"syncs, e.g. 50); got {sync_every!r}.")
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, numbers.Real) \
            or not math.isfinite(learning_rate) or learning_rate <= 0:
        raise ValueError(f"outer_learning_rate must be a finite number > 0 (DiLoCo: 0.7); "
                         f"got {learning_rate!r}.")
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) \
            or not 0 <= momentum < 1:
        raise ValueError(f"outer_momentum must be a number in [0, 1) (DiLoCo: 0.9); got "
                         f"{momentum!r}.")
    if not isinstance(nesterov, bool):
        raise TypeError(f"outer_nesterov must be True or False; got {nesterov!r}.")


def _pipeline_settings(spec, sizes, gradient_reduction, microbatches, repeats):
    """The checked microbatch count of a mesh's ``stage`` axis (the pipeline's own
    checks), refusing what the pipeline does not combine with (``seq`` and ``replica``:
    refused before, by the context and the DiLoCo checks)."""
    stages = sizes.get("stage", 1)
    if stages == 1 and microbatches not in (None, 1):
        raise ValueError(f"pipeline_microbatches={microbatches!r} needs a 'stage' mesh axis of "
                         f"size > 1; mesh '{spec}' has none. Add e.g. 'stage=2' to the spec, "
                         f"or leave pipeline_microbatches out.")
    if stages > 1 and gradient_reduction:
        raise ValueError(
            f"gradient_reduction={gradient_reduction!r} is not built for the 'stage' axis of "
            f"mesh '{spec}' (the pipeline's schedule runs per stage; the explicit reduction "
            f"runs per data x fsdp device). Use gradient_reduction=None (XLA places the "
            f"reductions) with a pipeline.")
    return stages_lib.check_settings(stages, microbatches, repeats)


def active() -> KdistDistribution | None:
    """The kdist distribution in force (``keras.distribution.set_distribution``), or None
    when there is none or it is another kind."""
    dist = keras.distribution.distribution()
    return dist if isinstance(dist, KdistDistribution) else None


def current_mesh_shape() -> dict[str, int]:
    """Axis sizes of the active kdist distribution; all 1 when none (or another kind) is set."""
    dist = keras.distribution.distribution()
    if isinstance(dist, KdistDistribution):
        return dict(dist.mesh_shape)
    sizes = {axis: 1 for axis in MESH_AXES}
    if dist is not None:
        sizes["data"] = getattr(dist, "num_model_replicas", 1)
    return sizes


def replica_count() -> int:
    """Number of model replicas the batch is split over under the active distribution."""
    shape = current_mesh_shape()
    return math.prod(shape[a] for a in REPLICA_AXES)


def divisors(n: int, at_most: int = 64) -> list[int]:
    """Mesh-axis sizes that divide ``n`` (up to ``at_most``), for error messages.

    Example:
        >>> divisors(12)
        [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, min(n, at_most) + 1) if n % d == 0]


def check_divisible(what: str, value: int, axis: str = "model") -> None:
    """Raises a ``ValueError`` with a fix if ``value`` does not divide by the mesh ``axis``.

    Models call this at construction so a bad shape is refused before any weight exists.
    """
    n = current_mesh_shape()[axis]
    if value % n:
        raise ValueError(
            f"{what}={value} is not divisible by the '{axis}' mesh axis of size {n}. "
            f"Use a '{axis}' size among {divisors(value)}, or choose {what} as a multiple "
            f"of {n}."
        )


def process_batch_share(global_batch_size: int) -> tuple[int, int]:
    """Which share of each global batch this process feeds: ``(share_index, share_count)``.

    Under a distribution, the JAX trainer assembles the global batch with
    ``jax.make_array_from_process_local_data``: each process passes the rows that live on its
    own devices. Those rows follow from the data layout, not from the process index: a
    process holds rows ``share_index * n ... (share_index + 1) * n`` with
    ``n = global_batch_size // share_count``, and processes whose devices hold the same
    replica (a ``model`` axis spanning processes) feed the same rows. ``(0, 1)`` on one
    process or without a distribution.

    Example:
        >>> process_batch_share(32)   # one process: the whole batch
        (0, 1)
    """
    import jax

    dist = keras.distribution.distribution()
    if dist is None or jax.process_count() == 1:
        return 0, 1
    shape = (global_batch_size, 1)
    sharding = dist.get_data_layout(shape).backend_layout
    spans = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows = index[0]
        spans.add((rows.start or 0, global_batch_size if rows.stop is None else rows.stop))
    start, stop = min(s for s, _ in spans), max(e for _, e in spans)
    covered = np.zeros(global_batch_size, bool)
    for s, e in spans:
        covered[s:e] = True
    size = stop - start
    if not covered[start:stop].all() or global_batch_size % size or start % size:
        raise ValueError(
            f"This process's devices hold batch rows {sorted(spans)} of {global_batch_size}, "
            f"which is not one contiguous, evenly sized share of the global batch, so a "
            f"per-process loader cannot feed it. Order the mesh devices process by process "
            f"(kdist.distribution() does, with jax.devices())."
        )
    return start // size, global_batch_size // size

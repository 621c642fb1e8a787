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

import dataclasses
import inspect
import math
import re
from collections.abc import Sequence

import keras
import numpy as np
from keras.distribution import DeviceMesh, LayoutMap, ModelParallel, TensorLayout

from kdist import _keras_compat
from kdist.parallel import auto, rules
from kdist.parallel import group_jobs as groups_job
from kdist.parallel.config import Parallelism
from kdist.parallel.mesh import MESH_AXES, REPLICA_AXES, batch_axes, device_grid, mesh_spec

# Weights with at most this many elements may have no logical axes and are then
# replicated (seed-generator states, metric accumulators, scalar counters).
REPLICATE_BELOW = 4096


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

    Build it with :func:`distribution`. ``config`` is the :class:`Parallelism` (the mesh
    and every feature's settings: pipeline, context, replica groups, gradient exchange)
    every kdist module reads; ``layout_for(path, shape)`` returns the layout a weight of
    that path and shape gets; ``mesh_shape`` gives the axis sizes.

    Example:
        >>> import jax
        >>> dist = distribution("data=2,model=4", jax.devices())
        >>> dist.mesh_shape["model"], dist.spec, dist.config.pipeline
        (4, 'data=2,model=4', None)
    """

    def __init__(self, device_mesh: DeviceMesh, config: Parallelism,
                 auto_shard_dataset: bool = True, auto_shard: bool = False,
                 allow_replicated: Sequence[str] = ()):
        # Before Keras' __init__, which reads num_model_replicas when there are several
        # processes.
        self.mesh_shape = dict(zip(device_mesh.axis_names, device_mesh.shape))
        self.config = config
        super().__init__(layout_map=LayoutMap(device_mesh), batch_dim_name="data",
                         auto_shard_dataset=auto_shard_dataset)
        # Weights without logical axes: kdist.parallel.auto (structure and shape).
        self.auto_shard = auto_shard
        self.allow_replicated = tuple(allow_replicated)

    @property
    def num_model_replicas(self) -> int:
        return math.prod(self.mesh_shape[a] for a in batch_axes(self.mesh_shape))

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
        if len(data_shape):
            self.check_batch(data_shape[0])
        return BatchLayout((REPLICA_AXES,) + (None,) * (len(data_shape) - 1), self.device_mesh)

    def check_batch(self, process_rows: int) -> None:
        """A ``ValueError`` naming the batch sizes that work if ``process_rows`` (this
        process's rows of a batch; Keras hands each batch of a ``fit`` here before it is
        sent to the devices) cannot be split over the replica axes: JAX's own error there
        names neither the axes nor a fix."""
        import jax

        rows, replicas = process_rows * jax.process_count(), self.num_model_replicas
        if rows % replicas == 0:
            return
        axes = ", ".join(f"{a}={self.mesh_shape[a]}" for a in batch_axes(self.mesh_shape))
        below = rows // replicas * replicas
        sizes = " or ".join(str(b) for b in (below, below + replicas) if b)
        raise ValueError(
            f"A batch of {rows} rows cannot be split over the batch axes ({axes}: "
            f"{replicas} model replicas, each taking an equal share). Use a batch size that "
            f"is a multiple of {replicas}, e.g. {sizes} (model.fit's batch_size, or a "
            f"recipe's --global-batch-size). From numpy arrays the last batch of an epoch "
            f"holds the remaining samples: make the sample count a multiple of the batch "
            f"size too, or pass a tf.data.Dataset batched with drop_remainder=True.")

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


def distribution(spec: str | Parallelism = "auto", devices: Sequence | None = None, *,
                 auto_shard_dataset: bool = False, auto_shard: bool = False,
                 allow_replicated: Sequence[str] = (),
                 gradient_reduction: str | None = None,
                 error_feedback: bool = False, sync_every: int | None = None,
                 outer_learning_rate: float = 0.7, outer_momentum: float = 0.9,
                 outer_nesterov: bool = True, pipeline_microbatches: int | None = None,
                 pipeline_repeats: int = 1, pipeline_schedule: str = "gpipe",
                 context_parallel: str = "all_gather",
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
    (:mod:`kdist.groups.diloco`): each group (its own ``data``/``fsdp``/``model``
    sub-mesh) takes H steps of the compiled optimizer on its share of every batch without
    communicating, then the groups average their parameter change and an outer SGD
    (``outer_learning_rate``, ``outer_momentum``, ``outer_nesterov``; the paper's 0.7, 0.9,
    Nesterov) moves the shared weights. A ``replica`` axis needs ``sync_every``.

    ``pipeline_microbatches`` and ``pipeline_repeats`` shape the schedule of a ``stage``
    axis (``"stage=4,fsdp=2"``: :mod:`kdist.parallel.pipeline`): each replica group's batch
    is cut into that many microbatches (default: one per stage; at least one per stage),
    and each device holds ``pipeline_repeats`` non-adjacent stages (circular repeats: the
    bubble falls from ``(S-1)/(M+S-1)`` to ``(S-1)/(R M+S-1)``). ``pipeline_schedule``
    orders the microbatches' forwards and backwards (:mod:`kdist.parallel.pipeline.schedules`):
    ``"gpipe"`` (default) every forward first; ``"1f1b"`` and ``"interleaved_1f1b"``
    (with ``pipeline_repeats >= 2`` chunks per stage) a backward as soon as it can run, so a
    stage holds about ``S`` microbatches' inputs instead of ``M`` microbatches' activations
    (:mod:`kdist.parallel.pipeline.interpreter`; a causal LM's or BERT's masked-LM default loss,
    ``stage`` with ``data``, ``fsdp`` and ``model``); ``"zero_bubble"`` (ZB-H1) splits
    1F1B's backward into the input gradient and the weight gradient, whose ticks fill the
    bubble: ``(S-1)/(3M+S-1)`` at 1F1B's memory, for one more forward per microbatch.

    A ``seq`` axis splits every sequence's tokens (context parallelism,
    :mod:`kdist.parallel.context`): ``context_parallel="all_gather"`` (default) gathers
    keys and values for each attention layer, ``"ring"`` passes them around the axis
    (``O(T / seq)`` memory); ``load_balance=True`` gives causal models' devices equal
    attention work (each holds two of ``2 x seq`` chunks; sequence lengths must divide by
    ``2 x seq``).

    ``spec`` may also be a :class:`kdist.parallel.config.Parallelism` — a plan's
    (``kdist.plan(...).parallelism``) or another distribution's ``config`` — whose mesh and
    settings are used; the keywords above are then left out.

    Example:
        >>> import keras, kdist
        >>> keras.distribution.set_distribution(kdist.distribution("auto"))
    """
    settings = dict(
        gradient_reduction=gradient_reduction, error_feedback=error_feedback,
        sync_every=sync_every, outer_learning_rate=outer_learning_rate,
        outer_momentum=outer_momentum, outer_nesterov=outer_nesterov,
        pipeline_microbatches=pipeline_microbatches, pipeline_repeats=pipeline_repeats,
        pipeline_schedule=pipeline_schedule, context_parallel=context_parallel,
        load_balance=load_balance)
    if isinstance(spec, Parallelism):
        defaults = inspect.signature(distribution).parameters
        typed = sorted(k for k, v in settings.items() if v != defaults[k].default)
        if typed:
            raise ValueError(
                f"kdist.distribution was given a Parallelism (mesh {spec.spec!r}, its "
                f"settings included) and also {', '.join(typed)}. Change the settings in one "
                f"place: pass the mesh spec string with your keywords, or the Parallelism "
                f"alone.")
        spec, settings = spec.spec, spec.settings
    devices = list(devices) if devices is not None else keras.distribution.list_devices()
    job = groups_job.from_environment()
    if job is not None:  # this process's job is one group; the others are other jobs
        if settings["sync_every"] is None:
            raise ValueError(
                f"This process is replica group {job.index} of {job.count} separate jobs "
                f"(KDIST_REPLICA_GROUP is set), which synchronise through DiLoCo's outer "
                f"step: pass sync_every=H (the recipes' --sync-every), e.g. "
                f"kdist.distribution({spec!r}, sync_every=50).")
        spec = groups_job.local_spec(spec, job)
    try:
        config = Parallelism.build(spec, len(devices), **settings)
    except ValueError as e:
        raise ValueError(_host_devices_hint(spec, devices) or str(e)) from None
    if job is not None:
        config = dataclasses.replace(
            config, replicas=dataclasses.replace(config.replicas, jobs=job))
    grid = device_grid(devices, config.mesh)
    mesh = DeviceMesh(shape=grid.shape, axis_names=MESH_AXES, devices=grid)
    return KdistDistribution(mesh, config, auto_shard_dataset=auto_shard_dataset,
                             auto_shard=auto_shard, allow_replicated=allow_replicated)


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
    """Number of model replicas the batch is split over under the active distribution
    (with separate group jobs, every group's: ``replica`` counts the jobs)."""
    shape = current_mesh_shape()
    return math.prod(shape[a] for a in batch_axes(shape)) * _job_groups()[1]


def _job_groups() -> tuple[int, int]:
    """``(this group, groups)`` when the groups are separate jobs, else ``(0, 1)``."""
    dist = active()
    job = None if dist is None or dist.config.replicas is None else dist.config.replicas.jobs
    return (0, 1) if job is None else (job.index, job.count)


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


def process_batch_share(global_batch_size: int, groups: bool = True) -> tuple[int, int]:
    """Which share of each global batch this process feeds: ``(share_index, share_count)``.

    With replica groups as separate jobs (:mod:`kdist.groups`), group ``g`` of ``G`` feeds
    rows ``g * B / G ... (g + 1) * B / G`` — the rows the ``replica`` axis gives group ``g``
    in one program — split among its processes as below; ``groups=False`` leaves the
    groups out (each group evaluates the whole validation batch).

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
    group, count = _job_groups() if groups else (0, 1)
    if global_batch_size % count:
        raise ValueError(f"The global batch of {global_batch_size} does not split into "
                         f"{count} replica groups' shares; use a multiple of {count}.")
    share, shares = _group_batch_share(global_batch_size // count)
    return group * shares + share, count * shares


def _group_batch_share(global_batch_size: int) -> tuple[int, int]:
    """:func:`process_batch_share` within one job."""
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

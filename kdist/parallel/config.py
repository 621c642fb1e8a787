"""One parallelism configuration: the mesh's axis sizes and one frozen record per feature.

:func:`kdist.distribution` builds a :class:`Parallelism` from its arguments, checks each
feature's own settings here and every combination against the one table of
:mod:`kdist.parallel.combinations`, and hands it to the distribution; every module of
:mod:`kdist.parallel` (and the planner, the recipes, the callbacks) reads the feature it
owns from ``dist.config`` — nothing else holds a setting.

Example:
    >>> config = Parallelism.build("stage=2,fsdp=4", 8, pipeline_microbatches=4)
    >>> config.pipeline, config.features
    (Pipeline(microbatches=4, repeats=1, schedule='gpipe'), frozenset({'fsdp', 'stage'}))
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from kdist.parallel import combinations
from kdist.parallel import mesh as _mesh
from kdist.parallel.group_jobs import JobGroups
from kdist.parallel.mesh import MESH_AXES, full_mesh, mesh_spec, parse_mesh

GRADIENT_REDUCTIONS = (None, "float32", "bfloat16", "float8", "int8")
COMPRESSED = ("float8", "int8")  # 8-bit codes on the wire
CONTEXT_PARALLEL = ("all_gather", "ring")  # how attention crosses a sequence split


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The ``stage`` axis' schedule: microbatches per step (per replica group) and
    circular repeats (stages per device)."""

    microbatches: int
    repeats: int = 1
    schedule: str = "gpipe"


@dataclasses.dataclass(frozen=True)
class Context:
    """How attention crosses a sequence split over ``seq``: ``"all_gather"`` or ``"ring"``;
    ``load_balance``: causal models' tokens in the balanced ("zigzag") layout."""

    variant: str = "all_gather"
    load_balance: bool = True


@dataclasses.dataclass(frozen=True)
class Replicas:
    """DiLoCo over the ``replica`` axis: inner steps between syncs and the outer SGD."""

    sync_every: int
    outer_learning_rate: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    jobs: JobGroups | None = None  # the groups are separate jobs (kdist.groups); this one's


@dataclasses.dataclass(frozen=True)
class Gradients:
    """Who reduces the gradients: None (XLA's partitioner) or kdist's reduction in
    ``"float32"``/``"bfloat16"``, or 8-bit codes (``"float8"``/``"int8"``, optionally with
    error feedback)."""

    reduction: str | None = None
    error_feedback: bool = False

    @property
    def compressed(self) -> bool:
        return self.reduction in COMPRESSED


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """The mesh and every feature's settings (None: the feature is off).

    ``features`` names what is on, in the terms of :mod:`kdist.parallel.combinations`:
    the axes of size > 1, ``"replica"`` for DiLoCo (also with one group),
    ``"reduction"`` / ``"8-bit"`` for kdist's gradient exchange.
    """

    sizes: tuple[tuple[str, int], ...]
    pipeline: Pipeline | None = None
    context: Context | None = None
    replicas: Replicas | None = None
    gradients: Gradients = Gradients()

    @property
    def mesh(self) -> dict[str, int]:
        """``{axis: size}`` for every axis of :data:`kdist.parallel.mesh.MESH_AXES`."""
        return dict(self.sizes)

    @property
    def spec(self) -> str:
        return mesh_spec(self.mesh)

    @property
    def stages(self) -> int:
        """Pipeline stages (the ``stage`` axis; 1: no pipeline)."""
        return self.mesh["stage"]

    @property
    def splits_sequence(self) -> bool:
        """Whether a ``seq`` axis splits every sequence's tokens."""
        return self.mesh["seq"] > 1

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes of size > 1 that split the batch, outermost first
        (:func:`kdist.parallel.mesh.batch_axes`)."""
        return _mesh.batch_axes(self.mesh)

    @property
    def summed_axes(self) -> tuple[str, ...]:
        """The axes a per-device gradient is partial over: the batch axes but ``replica``,
        and ``seq`` (:func:`kdist.parallel.mesh.summed_axes`)."""
        return _mesh.summed_axes(self.mesh)

    @property
    def has_replicas(self) -> bool:
        """Whether the ``replica`` axis trains DiLoCo groups (also one group)."""
        return self.replicas is not None

    @property
    def schedule(self) -> str:
        """The pipeline schedule (``"gpipe"`` without a pipeline)."""
        return "gpipe" if self.pipeline is None else self.pipeline.schedule

    @property
    def step_reduction(self) -> str | None:
        """The gradient exchange the step's per-device loss runs with
        (:mod:`kdist.parallel.reduction`): the one asked for; else float32 for replica
        groups with a split sequence — inside a group, XLA's partitioner cannot reshard a
        split sequence's keys and values among the automatic axes (a check failure in
        ``ExpandDeviceGroupsWithIota``, jaxlib 0.10.2), so there every device computes its
        own rows and tokens; None: XLA's partitioner reduces."""
        if self.gradients.reduction is not None:
            return self.gradients.reduction
        if self.has_replicas and self.splits_sequence:
            return "float32"
        return None

    @property
    def settings(self) -> dict:
        """The ``kdist.distribution`` keywords that build this configuration again (with
        :attr:`spec`): ``Parallelism.build(config.spec, n, **config.settings) == config``.

        Example:
            >>> Parallelism.build("stage=2,fsdp=4", 8, pipeline_microbatches=4).settings[
            ...     "pipeline_microbatches"]
            4
        """
        context, groups = self.context, self.replicas
        return {
            "gradient_reduction": self.gradients.reduction,
            "error_feedback": self.gradients.error_feedback,
            "sync_every": self.sync_every,
            "outer_learning_rate": 0.7 if groups is None else groups.outer_learning_rate,
            "outer_momentum": 0.9 if groups is None else groups.outer_momentum,
            "outer_nesterov": True if groups is None else groups.outer_nesterov,
            "pipeline_microbatches": self.microbatches,
            "pipeline_repeats": self.repeats,
            "pipeline_schedule": self.schedule,
            "context_parallel": self.context_variant,
            "load_balance": True if context is None else context.load_balance,
        }

    @property
    def features(self) -> frozenset[str]:
        found = {a for a, n in self.sizes if n > 1}
        if self.replicas is not None:
            found.add("replica")
        if self.gradients.reduction is not None:
            found.add("8-bit" if self.gradients.compressed else "reduction")
        if self.pipeline is not None and self.pipeline.schedule != "gpipe":
            found.add("schedule")
            if self.pipeline.schedule == "zero_bubble":
                found.add("zero_bubble")
        if self.context is not None and self.context.variant == "ring":
            found.add("ring")
        return frozenset(found)

    @classmethod
    def build(cls, spec: str, num_devices: int, *, gradient_reduction=None,
              error_feedback=False, sync_every=None, outer_learning_rate=0.7,
              outer_momentum=0.9, outer_nesterov=True, pipeline_microbatches=None,
              pipeline_repeats=1, pipeline_schedule="gpipe", context_parallel="all_gather",
              load_balance=True) -> Parallelism:
        """Parses ``spec``, checks every setting (a ``ValueError`` naming the argument and
        its valid values) and every combination (:func:`combinations.check`)."""
        sizes = parse_mesh(spec, num_devices)
        config = cls(
            sizes=tuple((a, sizes[a]) for a in MESH_AXES),
            pipeline=_pipeline(spec, sizes, pipeline_microbatches, pipeline_repeats,
                               pipeline_schedule),
            context=_context(sizes, context_parallel, load_balance),
            replicas=_replicas(spec, sizes, sync_every, outer_learning_rate, outer_momentum,
                               outer_nesterov),
            gradients=_gradients(gradient_reduction, error_feedback),
        )
        combinations.check(config.features, spec)
        return config

    @classmethod
    def unchecked(cls, sizes, *, gradient_reduction=None, sync_every=None,
                  pipeline_microbatches=None, pipeline_repeats=1, pipeline_schedule="gpipe",
                  context_parallel="all_gather", load_balance=True) -> Parallelism:
        """The records :meth:`build` makes of these settings on the axis ``sizes`` (a dict;
        absent axes have size 1), nothing checked: what the planner's analytic figures
        assume of any mesh, also one the distribution refuses (:mod:`kdist.planning`). As
        in :meth:`build`, a feature whose axis is off has no record, and the microbatches
        default to one per stage; ``sync_every`` alone makes the replica record.

        Example:
            >>> Parallelism.unchecked({"stage": 2, "seq": 2}, context_parallel="ring").pipeline
            Pipeline(microbatches=2, repeats=1, schedule='gpipe')
        """
        sizes = full_mesh(sizes)
        stages = sizes["stage"]
        return cls(
            sizes=tuple(sizes.items()),
            pipeline=(Pipeline(stages if pipeline_microbatches is None else pipeline_microbatches,
                               pipeline_repeats, pipeline_schedule) if stages > 1 else None),
            context=Context(context_parallel, load_balance) if sizes["seq"] > 1 else None,
            replicas=Replicas(sync_every) if sync_every else None,
            gradients=Gradients(gradient_reduction))

    @property
    def microbatches(self) -> int | None:
        """The pipeline's microbatches (None without a pipeline)."""
        return None if self.pipeline is None else self.pipeline.microbatches

    @property
    def repeats(self) -> int:
        """The pipeline's circular repeats (1 without a pipeline)."""
        return 1 if self.pipeline is None else self.pipeline.repeats

    @property
    def context_variant(self) -> str:
        """How attention crosses a ``seq`` split (``"all_gather"`` without one)."""
        return "all_gather" if self.context is None else self.context.variant

    @property
    def sync_every(self) -> int | None:
        """DiLoCo's inner steps between syncs (None without replica groups)."""
        return None if self.replicas is None else self.replicas.sync_every


def _gradients(reduction, error_feedback) -> Gradients:
    if reduction not in GRADIENT_REDUCTIONS:
        raise ValueError(f"gradient_reduction must be None (XLA places the reductions), "
                         f"'float32', 'bfloat16', 'float8' or 'int8'; got {reduction!r}.")
    if not isinstance(error_feedback, bool):
        raise TypeError(f"error_feedback must be True or False; got {error_feedback!r}.")
    if error_feedback and reduction not in COMPRESSED:
        raise ValueError(
            f"error_feedback=True carries the error of 8-bit gradient codes to the next step; "
            f"it needs gradient_reduction='float8' or 'int8', got {reduction!r}.")
    return Gradients(reduction, error_feedback)


def _context(sizes, variant, load_balance) -> Context | None:
    if variant not in CONTEXT_PARALLEL:
        raise ValueError(f"context_parallel must be one of {CONTEXT_PARALLEL} (how attention "
                         f"crosses a sequence split over 'seq'); got {variant!r}.")
    if not isinstance(load_balance, bool):
        raise ValueError(f"load_balance must be True or False; got {load_balance!r}.")
    return Context(variant, load_balance) if sizes["seq"] > 1 else None


def _named_axes(spec: str) -> set[str]:
    return {part.partition("=")[0].strip().lower() for part in str(spec).split(",")}


def _replicas(spec, sizes, sync_every, learning_rate, momentum, nesterov) -> Replicas | None:
    if sync_every is not None and "replica" not in _named_axes(spec):
        raise ValueError(
            f"sync_every={sync_every} trains replica groups with DiLoCo (the model's weights "
            f"then change only every {sync_every} steps), but mesh spec {spec!r} names no "
            f"'replica' axis. Name one: e.g. 'replica=2,fsdp=4' for two groups, or "
            f"'replica=1,...' for DiLoCo's outer step on a single group; or leave sync_every "
            f"out for plain training.")
    if sync_every is None:
        if sizes["replica"] > 1:
            raise ValueError(
                f"Mesh spec {spec!r} has a replica axis of {sizes['replica']}: replica groups "
                f"synchronise every few steps (DiLoCo) and need sync_every=H, e.g. "
                f"kdist.distribution({spec!r}, sync_every=50). For synchronous data "
                f"parallelism put those devices on 'data'.")
        return None
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
    return Replicas(int(sync_every), float(learning_rate), float(momentum), nesterov)


def _pipeline(spec, sizes, microbatches, repeats, schedule) -> Pipeline | None:
    from kdist.parallel.pipeline import schedules
    from kdist.parallel.pipeline.settings import check_settings

    stages = sizes["stage"]
    if schedule not in schedules.SCHEDULES:
        raise ValueError(f"pipeline_schedule must be one of {', '.join(schedules.SCHEDULES)}; "
                         f"got {schedule!r}.")
    if stages == 1 and schedule != "gpipe":
        raise ValueError(f"pipeline_schedule={schedule!r} orders a pipeline's microbatches; "
                         f"mesh '{spec}' has no 'stage' axis. Add e.g. 'stage=2' to the spec, "
                         f"or leave pipeline_schedule out.")
    if stages == 1 and microbatches not in (None, 1):
        raise ValueError(f"pipeline_microbatches={microbatches!r} needs a 'stage' mesh axis of "
                         f"size > 1; mesh '{spec}' has none. Add e.g. 'stage=2' to the spec, "
                         f"or leave pipeline_microbatches out.")
    microbatches = check_settings(stages, microbatches, repeats)
    if stages > 1:
        schedules.check(schedule, stages, microbatches, repeats)
    return Pipeline(microbatches, repeats, schedule) if stages > 1 else None

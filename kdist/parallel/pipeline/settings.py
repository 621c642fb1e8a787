"""The ``stage`` axis' settings and arithmetic: the pipeline's shape (:class:`Schedule`),
its bubble, and the checks of a distribution's ``pipeline_microbatches`` and
``pipeline_repeats`` (no JAX here: ``layout``, ``pipeline`` and ``planning`` share it).
"""

from __future__ import annotations

import dataclasses


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The idle share of a pipeline's iterations: ``(S - 1) / (R M + S - 1)``.

    Example:
        >>> round(bubble_fraction(4, 4), 4), round(bubble_fraction(4, 4, repeats=2), 4)
        (0.4286, 0.2727)
    """
    return (stages - 1) / (repeats * microbatches + stages - 1)


def check_settings(stages: int, microbatches: int | None, repeats: int) -> int:
    """Checks a distribution's pipeline settings; returns the microbatch count (default:
    one per stage). Raises ``ValueError`` naming the argument and the valid values.

    Example:
        >>> check_settings(4, None, 1)
        4
    """
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"pipeline_repeats must be a positive int (circular repeats; 1: "
                         f"plain GPipe); got {repeats!r}.")
    if microbatches is None:
        microbatches = stages
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"pipeline_microbatches must be a positive int; got {microbatches!r}.")
    if stages > 1 and microbatches < stages:
        raise ValueError(
            f"pipeline_microbatches={microbatches} is fewer than the {stages} pipeline stages: "
            f"some stage would never have work. Use pipeline_microbatches >= {stages} (e.g. "
            f"{stages} or {2 * stages}; the bubble is (S-1)/(R*M+S-1)).")
    if stages == 1 and repeats > 1:
        raise ValueError(f"pipeline_repeats={repeats} needs a 'stage' mesh axis of size > 1; "
                         f"the mesh has none. Add e.g. 'stage=2' to the mesh spec or use "
                         f"pipeline_repeats=1.")
    return microbatches


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline's shape: ``stages`` S, ``repeats`` R, ``microbatches`` M, ``replicas``
    (devices per stage that split the batch: the product of the replica axes), the layer
    count and the JAX mesh.

    Example:
        >>> s = Schedule(stages=4, repeats=2, microbatches=8, replicas=2, num_layers=16)
        >>> s.iterations, s.layers_per_stage, round(s.bubble, 3)
        (19, 4, 0.158)
    """

    stages: int
    repeats: int
    microbatches: int
    replicas: int
    num_layers: int
    mesh: object = None

    @property
    def iterations(self) -> int:
        """Scan iterations of the schedule: ``R M + S - 1``."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def layers_per_stage(self) -> int:
        """Layers a stage applies per iteration: ``L / (R S)``."""
        return self.num_layers // (self.repeats * self.stages)

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.stages, self.microbatches, self.repeats)

    def permute_bytes(self, microbatch_activation_bytes: float) -> float:
        """Bytes each device sends to its neighbour per training step: one microbatch
        activation per iteration forward and one cotangent per iteration backward."""
        return 2 * self.iterations * microbatch_activation_bytes

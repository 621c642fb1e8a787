"""The training (and evaluation) step over a ``seq`` axis: the sequence's layout, the
load-balancing reorder and its undoing.

:func:`loss_and_updates` wraps the step's ``compute_loss_and_updates``: it checks the
sequence length against the layout (a ``ValueError`` while tracing, before XLA compiles
anything), reorders every per-token array of ``x``, ``y`` and ``sample_weight`` into
layout order when the layout is balanced (a gather along the sequence of arrays that are
replicated over ``seq``, so no device sends anything), pins them to each device's share,
traces the step under the layout (positions, masks and attention read it), and puts the
predictions back in true order. The loss is a mean over tokens, so reordering changes
nothing in it but the summation order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kdist.parallel import mesh as _mesh
from kdist.parallel import region
from kdist.parallel.constraints import shard_batch
from kdist.parallel.context.token_layout import AXIS, SequenceLayout, sequence_layout, step_layout
from kdist.parallel.layout import active
from kdist.parallel.transform import Transform, declares


def sequence_length(model, x) -> int | None:
    """The token length of a batch: axis 1 of its token ids (the task's first
    ``token_id_inputs`` key of a dict ``x``), or None."""
    keys = getattr(model, "token_id_inputs", ("token_ids",))
    ids = x.get(keys[0]) if isinstance(x, Mapping) else x
    shape = getattr(ids, "shape", ())
    return shape[1] if len(shape) >= 2 and isinstance(shape[1], int) else None


def _per_token(array, length) -> bool:
    shape = getattr(array, "shape", ())
    return len(shape) >= 2 and shape[1] == length


def check_length(length: int, devices: int, balanced: bool, max_length: int | None,
                 what: str = "sequence length") -> SequenceLayout:
    """The layout of ``length`` tokens over ``devices``, or a ``ValueError`` naming valid
    lengths (and the model's maximum)."""
    if max_length is not None and length > max_length:
        raise ValueError(f"The {what} {length} exceeds the model's max_sequence_length "
                         f"{max_length}. Build the model with a larger max_sequence_length "
                         f"or use shorter sequences.")
    return SequenceLayout(length, devices, balanced)


def loss_and_updates(model, compute, x, y, sample_weight, *, reorder: bool):
    """``compute(x, y, sample_weight)`` (the step's loss and updates) over a split sequence.

    ``reorder``: the task allows reordering its tokens (``"token_reordering"`` step
    feature); with the distribution's ``load_balance`` the layout is then balanced.
    """
    dist = active()
    length = sequence_length(model, x)
    if length is None:
        raise ValueError("A 'seq' mesh axis splits each sequence, but this batch has no token "
                         "ids of known length (axis 1 of x or of x['token_ids']).")
    backbone = getattr(model, "backbone", None)
    balanced = reorder and dist.config.context.load_balance
    layout = check_length(length, dist.mesh_shape[AXIS], balanced,
                          getattr(backbone, "max_sequence_length", None))
    order = jnp.asarray(layout.order(), jnp.int32)

    def arrange(a):
        if not _per_token(a, length):
            return a
        if layout.balanced:  # into layout order: device i's two chunks side by side
            a = jnp.take(a, order, axis=1)
        # Rows over the replica axes (those still automatic here), tokens over seq.
        return shard_batch(a) if _divides(a, dist) else a

    x, y, sample_weight = jax.tree.map(arrange, (x, y, sample_weight))
    with sequence_layout(layout):
        loss, (unscaled, y_pred, non_trainable, metrics) = compute(x, y, sample_weight)
    if layout.balanced:  # back to true order for the metrics
        inverse = jnp.asarray(layout.inverse(), jnp.int32)
        y_pred = jax.tree.map(
            lambda a: jnp.take(a, inverse, axis=1) if _per_token(a, length) else a, y_pred)
    return loss, (unscaled, y_pred, non_trainable, metrics)


def _divides(a, dist) -> bool:
    sizes = dist.mesh_shape
    automatic = region.current().automatic(sizes)
    rows = math.prod(sizes[a] for a in _mesh.batch_axes(sizes, automatic))
    return a.shape[0] % rows == 0


def row_spec(array, batch_axes) -> P:
    """Inside kdist's per-device region (:mod:`kdist.parallel.reduction`): the
    ``shard_map`` spec of a per-row array of the step — rows over ``batch_axes`` and, for
    a per-token array of a split sequence, tokens over ``seq``.

    Example:
        >>> import jax.numpy as jnp
        >>> row_spec(jnp.zeros((8, 16)), ("data",))
        P('data',)
    """
    layout = step_layout()
    rows = batch_axes or None
    if layout is not None and _per_token(array, layout.length):
        return P(rows, AXIS)
    return P(rows)


def output_spec(batch_axes) -> P:
    """The ``shard_map`` spec of the step's predictions inside kdist's per-device region:
    rows over ``batch_axes``, and tokens (axis 1) over ``seq`` while a split sequence is
    traced (the predictions of a task that splits sequences are per token)."""
    return P(batch_axes or None, AXIS) if step_layout() is not None else P(batch_axes or None)


def summed_axes() -> tuple[str, ...]:
    """Mesh axes besides the replicas over which a per-device loss and its gradients are
    partial: ``("seq",)`` while a split sequence is traced, else ``()``."""
    return (AXIS,) if step_layout() is not None else ()


def _refusal(dist, model) -> str:
    return (f"Mesh {dist.spec} splits every sequence over 'seq' (context parallelism), which "
            f"{type(model).__name__} does not support (it does not declare the "
            f"'context_parallel' step feature): each device would compute what its 'seq' "
            f"neighbours compute. Put those devices on data, fsdp or model.")


def _wrap(compute, step):
    reorder = declares(step.model, "token_reordering")

    def split(trainable, non_trainable, metrics, x, y, sample_weight, optimizer_variables):
        def inner(x, y, sample_weight):
            return compute(trainable, non_trainable, metrics, x, y, sample_weight,
                           optimizer_variables)
        return loss_and_updates(step.model, inner, x, y, sample_weight, reorder=reorder)
    return split


# The step over a sequence split on 'seq' (training and evaluation alike).
TRANSFORM = Transform("split sequence", wanted=lambda dist: dist.config.splits_sequence,
                      feature="context_parallel", refusal=_refusal, wrap=_wrap)

"""Mesh specs, sharding rules and the Keras distribution that applies them.

A *mesh spec* names how the devices are arranged: ``"fsdp=8"``, ``"data=2,model=4"``,
``"data=2,fsdp=2,model=2"``, ``"fsdp=-1,model=2"`` (``-1`` takes the remaining devices),
``"auto"`` (every device on ``fsdp``) or a strategy name (``"dp"``, ``"fsdp"``, ``"tp"``).
The mesh always has the three axes ``data``, ``fsdp`` and ``model``; unnamed axes have size 1.

Every kdist model keeps a table from weight-path pattern to *logical axes* (what each
dimension means: ``vocab``, ``embed``, ``heads``, ...). ``LOGICAL_TO_MESH`` maps logical axes
to mesh axes, so one rule set serves every strategy: ``embed -> fsdp`` gives ZeRO-3 style
weight sharding, ``heads/mlp/vocab -> model`` gives Megatron-style tensor parallelism, and a
mesh axis of size 1 simply drops out. The batch is sharded over both replica axes
(``data`` and ``fsdp``) at once — Keras' ``TensorLayout`` takes one mesh axis per dimension,
so :class:`BatchLayout` extends it to accept a tuple.

Every weight layout is checked when the variable is created, i.e. when the model is built
and before anything compiles: a large weight that matches no table entry is an error (no
silent replication), and a sharded dimension must divide by its mesh axis.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import keras
import numpy as np
from keras.distribution import DeviceMesh, LayoutMap, ModelParallel, TensorLayout

from kdist.reduction import in_manual_region

MESH_AXES = ("data", "fsdp", "model")
REPLICA_AXES = ("data", "fsdp")

# The strategy rules: which mesh axis each logical axis of a weight is sharded over. Axes
# not listed (head_dim, position, norm) are never sharded.
LOGICAL_TO_MESH: dict[str, str] = {
    "embed": "fsdp",
    "vocab": "model",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
}
LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "position", "norm")

# Weights with at most this many elements may be absent from a model's table and are then
# replicated (seed-generator states, metric accumulators, scalar counters).
REPLICATE_BELOW = 4096

_STRATEGIES = {"dp": "data", "fsdp": "fsdp", "tp": "model"}

# Logical-axes tables registered by the model modules: pattern -> logical axes.
_TABLES: dict[str, tuple[str | None, ...]] = {}


def register_logical_axes(table: Mapping[str, Sequence[str | None]]) -> None:
    """Registers a model's table from weight-path regex to logical axes.

    Patterns are matched with ``re.fullmatch`` against ``variable.path``. Registering the
    same pattern twice with the same axes is a no-op; with different axes it is an error.

    Example:
        >>> register_logical_axes({r"(.*/)?my_dense/kernel": ("embed", "mlp")})
    """
    for pattern, axes in table.items():
        axes = tuple(axes)
        unknown = [a for a in axes if a is not None and a not in LOGICAL_AXES]
        if unknown:
            raise ValueError(
                f"Logical axes {unknown} of pattern {pattern!r} are unknown. "
                f"Expected names from {LOGICAL_AXES} (or None)."
            )
        if _TABLES.get(pattern, axes) != axes:
            raise ValueError(
                f"Pattern {pattern!r} is already registered with logical axes "
                f"{_TABLES[pattern]}; refusing to redefine it as {axes}."
            )
        _TABLES[pattern] = axes


def logical_axes_for(path: str) -> tuple[str | None, ...] | None:
    """Returns the logical axes registered for a weight path, or None.

    Raises ``ValueError`` if several patterns with different axes match the path.
    """
    matches = {p: a for p, a in _TABLES.items() if re.fullmatch(p, path)}
    if len(set(matches.values())) > 1:
        raise ValueError(
            f"Weight '{path}' matches several logical-axes patterns with different axes: "
            f"{matches}. Make the patterns in the model's table mutually exclusive."
        )
    return next(iter(matches.values()), None)


def parse_mesh(spec: str, num_devices: int) -> dict[str, int]:
    """Parses a mesh spec into ``{"data": d, "fsdp": f, "model": m}`` with ``d*f*m == num_devices``.

    Example:
        >>> parse_mesh("data=2,model=-1", 8)
        {'data': 2, 'fsdp': 1, 'model': 4}
        >>> parse_mesh("auto", 8)
        {'data': 1, 'fsdp': 8, 'model': 1}
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"Mesh spec must be a non-empty string such as 'fsdp=8' or 'data=2,model=4'; "
            f"got {spec!r}."
        )
    text = spec.strip().lower()
    if text == "auto":
        text = "fsdp=-1"
    elif text in _STRATEGIES:
        text = f"{_STRATEGIES[text]}=-1"
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not name:
            raise ValueError(
                f"Mesh spec {spec!r}: '{part}' is not of the form AXIS=SIZE. "
                f"Write e.g. 'data=2,fsdp=2,model=2', or 'auto'."
            )
        if name not in MESH_AXES:
            raise ValueError(
                f"Mesh spec {spec!r}: unknown axis '{name}'. Valid axes are "
                f"{', '.join(MESH_AXES)} (or the shorthands auto, dp, fsdp, tp)."
            )
        if name in sizes:
            raise ValueError(f"Mesh spec {spec!r}: axis '{name}' is given twice.")
        try:
            size = int(value)
        except ValueError:
            raise ValueError(
                f"Mesh spec {spec!r}: size of '{name}' must be an integer (or -1), got '{value}'."
            ) from None
        if size == 0 or size < -1:
            raise ValueError(
                f"Mesh spec {spec!r}: size of '{name}' must be a positive integer or -1, "
                f"got {size}."
            )
        sizes[name] = size
    wildcards = [n for n, s in sizes.items() if s == -1]
    if len(wildcards) > 1:
        raise ValueError(
            f"Mesh spec {spec!r}: only one axis may be -1 (it takes the remaining devices); "
            f"got {wildcards}."
        )
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if wildcards:
        if num_devices % fixed:
            raise ValueError(
                f"Mesh spec {spec!r}: the fixed axes use {fixed} devices, which does not divide "
                f"the {num_devices} available, so '{wildcards[0]}=-1' has no integer size. "
                f"Choose sizes whose product divides {num_devices}."
            )
        sizes[wildcards[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(
            f"Mesh spec {spec!r} describes {fixed} devices, but {num_devices} are available. "
            f"The product of the axis sizes must equal the device count: e.g. "
            f"'fsdp={num_devices}', or put -1 on one axis ('data=-1,model=2') to take the rest."
        )
    return {axis: sizes.get(axis, 1) for axis in MESH_AXES}


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
    weight of that path and shape gets; ``mesh_shape`` gives the axis sizes.
    """

    def __init__(self, device_mesh: DeviceMesh, auto_shard_dataset: bool = True,
                 auto_shard: bool = False, allow_replicated: Sequence[str] = (),
                 gradient_reduction: str | None = None):
        # Before Keras' __init__, which reads num_model_replicas when there are several
        # processes.
        self.mesh_shape = dict(zip(device_mesh.axis_names, device_mesh.shape))
        self.gradient_reduction = gradient_reduction
        layout_map = LayoutMap(device_mesh)
        super().__init__(
            layout_map=layout_map, batch_dim_name="data", auto_shard_dataset=auto_shard_dataset
        )
        # Weights without a logical-axes table: kdist.auto_sharding (structure and shape).
        self.auto_shard = auto_shard
        self.allow_replicated = tuple(allow_replicated)

    @property
    def num_model_replicas(self) -> int:
        return math.prod(self.mesh_shape[a] for a in REPLICA_AXES)

    @property
    def spec(self) -> str:
        """The mesh as a spec string, e.g. ``'data=2,fsdp=2,model=2'``."""
        return ",".join(f"{a}={s}" for a, s in self.mesh_shape.items() if s > 1) or "data=1"

    def mesh_axis_for(self, logical_axis: str | None) -> str | None:
        """The mesh axis a logical axis is sharded over here, or None if replicated."""
        mesh_axis = LOGICAL_TO_MESH.get(logical_axis)
        if mesh_axis is None or self.mesh_shape[mesh_axis] == 1:
            return None
        return mesh_axis

    def get_data_layout(self, data_shape):
        return BatchLayout((REPLICA_AXES,) + (None,) * (len(data_shape) - 1), self.device_mesh)

    def layout_for(self, path: str, shape: Sequence[int]) -> TensorLayout:
        """The checked layout of a weight; raises ``ValueError`` with a fix if there is none."""
        shape = tuple(shape)
        logical = logical_axes_for(path)
        if logical is None and self.auto_shard:
            from kdist.auto_sharding import infer_axes

            axes, _ = infer_axes(path, shape, self.mesh_shape,
                                 replicate_below=REPLICATE_BELOW,
                                 allow_replicated=self.allow_replicated)
            return TensorLayout(axes, self.device_mesh)
        if logical is None:
            size = math.prod(shape)
            if size > REPLICATE_BELOW:
                raise ValueError(
                    f"Weight '{path}' (shape {shape}, {size:,} elements) matches no entry of any "
                    f"registered logical-axes table, so it would be silently replicated on every "
                    f"device. Add a pattern for it to the model's table (see "
                    f"kdist.distribution.register_logical_axes), rename the layer to match one, "
                    f"or shard it automatically: kdist.distribution(spec, auto_shard=True)."
                )
            return TensorLayout((None,) * len(shape), self.device_mesh)
        if len(logical) != len(shape):
            raise ValueError(
                f"Weight '{path}' has shape {shape} ({len(shape)} dims) but its table entry names "
                f"{len(logical)} logical axes {logical}. Fix the model's logical-axes table."
            )
        axes = []
        for dim, (logical_axis, size) in enumerate(zip(logical, shape)):
            mesh_axis = self.mesh_axis_for(logical_axis)
            if mesh_axis is not None and size % self.mesh_shape[mesh_axis]:
                n = self.mesh_shape[mesh_axis]
                raise ValueError(
                    f"Weight '{path}' (shape {shape}) cannot be sharded: dimension {dim} "
                    f"('{logical_axis}', size {size}) does not divide by the '{mesh_axis}' mesh "
                    f"axis of size {n}. Use a '{mesh_axis}' size among {_divisors(size)}, or "
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
        if getattr(variable, "_layout", None) is not None:
            return variable._layout
        return self.layout_for(variable.path, variable.shape)


def distribution(spec: str = "auto", devices: Sequence | None = None, *,
                 auto_shard_dataset: bool = False, auto_shard: bool = False,
                 allow_replicated: Sequence[str] = (),
                 gradient_reduction: str | None = None) -> KdistDistribution:
    """Builds the Keras distribution for a mesh spec over all (or the given) devices.

    Set it before building the model; ``compile`` and ``fit`` then run sharded. With several
    processes, kdist's datasets already yield each process's own share of the global batch
    (see :func:`process_batch_share`), so Keras' auto-sharding stays off; pass
    ``auto_shard_dataset=True`` to feed a global ``tf.data.Dataset`` instead, which Keras
    then splits by process. ``auto_shard=True`` shards weights that no kdist table names
    (keras-hub or your own model) by structure and shape (``kdist.auto_sharding``);
    ``allow_replicated`` lists path regexes of large weights that may stay replicated.
    ``gradient_reduction="float32"`` or ``"bfloat16"``: kdist's GPT models reduce each
    weight's gradient themselves, once, as a reduce-scatter over ``fsdp`` and an all-reduce
    over ``data``, in that type (``kdist.reduction``; meshes without ``model``, no dropout);
    None leaves the reductions to XLA.

    Example:
        >>> import keras, kdist
        >>> keras.distribution.set_distribution(kdist.distribution("auto"))
    """
    if gradient_reduction not in (None, "float32", "bfloat16"):
        raise ValueError(f"gradient_reduction must be None (XLA places the reductions), "
                         f"'float32' or 'bfloat16'; got {gradient_reduction!r}.")
    devices = list(devices) if devices is not None else keras.distribution.list_devices()
    shape = tuple(parse_mesh(spec, len(devices)).values())  # (data, fsdp, model)
    if gradient_reduction and shape[2] > 1:
        raise ValueError(
            f"gradient_reduction={gradient_reduction!r} covers the data and fsdp axes; mesh "
            f"'{spec}' has a model axis of {shape[2]}. Use a mesh without 'model' or "
            f"gradient_reduction=None (XLA places the reductions).")
    mesh = DeviceMesh(shape=shape, axis_names=MESH_AXES,
                      devices=np.asarray(devices).reshape(shape))
    return KdistDistribution(mesh, auto_shard_dataset=auto_shard_dataset,
                             auto_shard=auto_shard, allow_replicated=allow_replicated,
                             gradient_reduction=gradient_reduction)


def shard_batch(x):
    """Pins an activation's batch dimension to the replica axes (the rest replicated).

    Models call this on each block's output. Without it XLA's partitioner propagates the
    weights' fsdp sharding into the activations and reshards them back and forth (measured
    3.5x slower steps under fsdp=8 on CPU). A batch that does not divide by the replicas
    (e.g. generating one sequence) is left to XLA. Identity without a kdist distribution.
    """
    dist = keras.distribution.distribution()
    batch = x.shape[0]
    if not isinstance(dist, KdistDistribution) or not isinstance(batch, int):
        return x
    if in_manual_region():  # a per-device computation (kdist.reduction): nothing to pin
        return x
    if batch % dist.num_model_replicas:
        return x
    layout = BatchLayout((REPLICA_AXES,) + (None,) * (len(x.shape) - 1), dist.device_mesh)
    return keras.distribution.distribute_tensor(x, layout)


def gathered(x, logical_axes: Sequence[str | None]):
    """Constrains a weight to its layout minus the ``fsdp`` axis: FSDP's all-gather before use.

    XLA inserts this all-gather by itself around matmuls; a gather (embedding lookup) from
    an fsdp-sharded table instead yields an embed-sharded result that XLA can only reshard
    by replicating it. Identity when no kdist distribution is active.
    """
    dist = keras.distribution.distribution()
    if not isinstance(dist, KdistDistribution) or in_manual_region():
        return x
    axes = tuple(m if m != "fsdp" else None for m in map(dist.mesh_axis_for, logical_axes))
    return keras.distribution.distribute_tensor(x, TensorLayout(axes, dist.device_mesh))


def current_mesh_shape() -> dict[str, int]:
    """Axis sizes of the active kdist distribution; all 1 when none (or another kind) is set."""
    dist = keras.distribution.distribution()
    if isinstance(dist, KdistDistribution):
        return dict(dist.mesh_shape)
    if dist is not None:
        return {"data": getattr(dist, "num_model_replicas", 1), "fsdp": 1, "model": 1}
    return {axis: 1 for axis in MESH_AXES}


def replica_count() -> int:
    """Number of model replicas the batch is split over under the active distribution."""
    shape = current_mesh_shape()
    return shape["data"] * shape["fsdp"]


def _divisors(n: int, at_most: int = 64) -> list[int]:
    """Mesh-axis sizes that divide ``n`` (up to ``at_most``), for error messages."""
    return [d for d in range(1, min(n, at_most) + 1) if n % d == 0]


def check_divisible(what: str, value: int, axis: str = "model") -> None:
    """Raises a ``ValueError`` with a fix if ``value`` does not divide by the mesh ``axis``.

    Models call this at construction so a bad shape is refused before any weight exists.
    """
    n = current_mesh_shape()[axis]
    if value % n:
        raise ValueError(
            f"{what}={value} is not divisible by the '{axis}' mesh axis of size {n}. "
            f"Use a '{axis}' size among {_divisors(value)}, or choose {what} as a multiple "
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

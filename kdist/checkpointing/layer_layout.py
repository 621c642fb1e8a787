"""Restoring across layer layouts: a checkpoint of unstacked blocks into a stacked model
(``scan_layers=True``, a pipeline) and back, or between pipelines' repeats.

The training state's keys name the same weights either way (``params.block_3.mlp.up.
kernel`` is layer 3 of ``params.blocks.mlp.up.kernel``, and so are their Adam moments);
:mod:`kdist.models.stacking` decides, from the saved shapes alone, how each of the model's
variables is made from the saved arrays. Each source array is read straight into a
sharding derived from its target's (a stacked source with its layer dims unsharded, a
layer of a stack with the stack's layout minus the layer dims), then stacked, sliced or
re-viewed into the target's own sharding: pure data movement, so the values are exact.

Dropout seed states are per layer in one layout and per stack in the other: they do not
convert, so the model keeps its own (the weights, optimizer state, step and schedule are
restored exactly; the dropout masks that follow differ, as they would on another mesh).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kdist.models import stacking


def _converted_keys(saved: dict, variables: dict, keys) -> list[str]:
    """The keys of ``variables`` (among ``keys``) the checkpoint does not hold as they are."""
    return [k for k in keys if k not in saved
            or tuple(saved[k]["shape"]) != tuple(variables[k].shape)]


def plan(saved: dict, variables: dict, keys) -> dict | None:
    """How to make the variables the checkpoint does not hold as they are, or None when it
    holds them all. ``saved`` is the metadata's ``variables``. Raises ``ValueError`` (naming
    the weights) when they differ by more than the layer layout; dropout seed states are
    left out (see the module docstring)."""
    missing = [k for k in _converted_keys(saved, variables, keys) if not k.startswith("rng.")]
    if not missing:
        return None
    target = {k: tuple(variables[k].shape) for k in missing}
    return stacking.conversion_plan(target, {k: v["shape"] for k, v in saved.items()})


def used_keys(conversion: dict) -> set[str]:
    """The saved keys a conversion reads."""
    return {k for source in conversion.values() for k in source.keys}


def _spec(sharding, rank: int):
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return spec + (None,) * (rank - len(spec))


def _source_sharding(target_sharding, target_rank: int, drop: int, add: int):
    """The target's sharding without its first ``drop`` dims and with ``add`` unsharded
    leading dims: for a source array that has other layer dims than its target."""
    if not isinstance(target_sharding, NamedSharding):
        return target_sharding  # one device
    spec = (None,) * add + _spec(target_sharding, target_rank)[drop:]
    return NamedSharding(target_sharding.mesh, P(*spec))


def _layer_dims(source, source_shape: tuple, target_shape: tuple) -> tuple[int, int]:
    """``(target's, source's)`` leading layer dims that differ between the two."""
    if source.kind == "stack":
        return len(target_shape) - len(source_shape), 0
    if source.kind == "slice":
        return 0, len(source_shape) - len(target_shape)
    if source_shape == target_shape:
        return 0, 0
    for t in (1, 2):
        for s in (1, 2):
            if target_shape[t:] == source_shape[s:]:
                return t, s
    raise ValueError(f"{source_shape} and {target_shape} are not views of one stack.")


def read_converted(step_dir, saved: dict, variables: dict, conversion: dict,
                   restore_tree) -> dict:
    """The converted variables' values, each in its variable's current sharding.
    ``restore_tree(step_dir, {key: ShapeDtypeStruct})`` reads saved arrays; a stack that
    feeds several unstacked layers is read once (kept until its last layer is made)."""
    uses: dict[str, int] = {}
    for source in conversion.values():
        for k in source.keys:
            uses[k] = uses.get(k, 0) + 1
    cache, out = {}, {}
    for key, source in conversion.items():
        variable = variables[key]
        target_shape = tuple(variable.shape)
        target = variable.value.sharding
        wanted = {}
        for k in source.keys:
            if k not in cache:
                shape = tuple(saved[k]["shape"])
                drop, add = _layer_dims(source, shape, target_shape)
                wanted[k] = jax.ShapeDtypeStruct(
                    shape, variable.dtype,
                    sharding=_source_sharding(target, len(target_shape), drop, add))
        if wanted:
            cache.update(restore_tree(step_dir, wanted))
        make = jax.jit(lambda a, s=source: stacking.apply_plan({"x": s}, a, jnp)["x"],
                       out_shardings=target)
        out[key] = make({k: cache[k] for k in source.keys})
        for k in source.keys:
            uses[k] -= 1
            if not uses[k]:
                del cache[k]
    return out


def warn_rng(saved: dict, variables: dict) -> None:
    """Warns that dropout seed states did not convert, when they differ."""
    have = sorted(k for k in variables if k.startswith("rng."))
    were = sorted(k for k in saved if k.startswith("rng."))
    if have != were:
        warnings.warn(f"The checkpoint's blocks are laid out differently (stacked or not): its "
                      f"{len(were)} dropout seed states do not map to this model's {len(have)}, "
                      f"which keep their own values. Weights, optimizer state and step are "
                      f"restored exactly.", stacklevel=3)

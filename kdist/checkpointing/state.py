"""The training state as checkpoint keys, and reading it back into a model's variables
(straight into their current shardings, so a checkpoint restores onto another mesh)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import keras

from kdist.checkpointing import layer_layout
from kdist.checkpointing.format import ITEM_DIR, read_metadata


def state_variables(model: keras.Model) -> dict[str, keras.Variable]:
    """The training state of a compiled model as ``{checkpoint key: variable}``.

    Keys are stable across processes and runs: ``params.<path>`` (trainable weights),
    ``state.<path>`` (other non-trainable weights), ``rng.seed_generator_<i>`` (dropout
    seed-generator states, by order: their Keras names depend on how many were created
    before), ``optimizer.<path>`` (Adam moments, ``iteration`` — hence the learning-rate
    schedule — and gradient accumulators) and ``metrics.<path>`` (the running epoch means,
    so a resumed epoch logs the same loss).

    Builds the optimizer first if ``fit`` has not (an unbuilt optimizer has no slots,
    and Keras' ``set_state_tree`` would silently skip them).

    Example:
        >>> from tests.helpers import tiny_gpt
        >>> model = tiny_gpt(); model.compile(optimizer="adamw")
        >>> sorted(state_variables(model))[:2]
        ['metrics.loss.count', 'metrics.loss.total']
    """
    if getattr(model, "optimizer", None) is None:
        raise ValueError(
            "The model is not compiled, so it has no optimizer state to save or restore. "
            "Call model.compile(optimizer=...) before creating the checkpoint state."
        )
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    out: dict[str, keras.Variable] = {}

    def add(key, variable):
        key = key.replace("/", ".")
        if key in out:
            raise ValueError(f"Two variables map to the checkpoint key {key!r}: "
                             f"{out[key].path} and {variable.path}. Give them distinct names.")
        out[key] = variable

    for v in model.trainable_variables:
        add(f"params.{v.path}", v)
    seed = 0
    for v in model.non_trainable_variables:
        if v.path.endswith("seed_generator_state"):
            add(f"rng.seed_generator_{seed}", v)
            seed += 1
        else:
            add(f"state.{v.path}", v)
    for v in model.optimizer.variables:
        add(f"optimizer.{v.path.split('/', 1)[-1]}", v)  # drop "adam_w_1/": build-order name
    for v in model.metrics_variables:
        add(f"metrics.{v.path}", v)
    return out


def loss_mean(metrics: dict) -> tuple[float, float]:
    """``(total, count)`` of Keras' running loss mean among restored ``metrics.*`` values;
    zeros where there are none (the mean Keras resets at an epoch's start).

    Example:
        >>> loss_mean({"metrics.loss.total": 7.0, "metrics.loss.count": 2.0})
        (7.0, 2.0)
    """
    return float(metrics.get("metrics.loss.total", 0.0)), float(
        metrics.get("metrics.loss.count", 0.0))


_all_finite = jax.jit(lambda xs: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs])))


def all_finite(variables: dict[str, keras.Variable]) -> bool:
    """Whether every floating-point weight (``params.*``) is finite.

    The weights only: a third of the state (the Adam moments are 2x its size), and a
    non-finite moment makes the weights non-finite at the next update anyway.
    """
    floats = [v.value for k, v in variables.items()
              if k.startswith("params.") and jnp.issubdtype(v.value.dtype, jnp.floating)]
    return bool(_all_finite(floats)) if floats else True


def check_compatible(meta, variables, step_dir, keys=None) -> None:
    """ValueError naming every variable whose shape differs, is missing or is extra — other
    than blocks stacked in one and unstacked in the other (``scan_layers``, pipelines),
    which :mod:`.layer_layout` converts exactly."""
    saved = meta.get("variables", {})
    try:
        conversion = layer_layout.plan(saved, variables, keys or variables)
    except ValueError:
        conversion = None  # not a layout difference: the problems below say what
    if conversion:
        used = layer_layout.used_keys(conversion)
        unread = [saved[k]["path"] for k in saved if k not in variables and k not in used
                  and not k.startswith("rng.") and (keys is None or k.split(".")[0] in {
                      x.split(".")[0] for x in keys})]
        if not unread:
            return
    problems = []
    for key in keys or variables:
        v = variables[key]
        if key not in saved:
            problems.append(f"{v.path} (shape {tuple(v.shape)}) is not in the checkpoint")
        elif tuple(saved[key]["shape"]) != tuple(v.shape):
            problems.append(f"{v.path}: checkpoint shape {tuple(saved[key]['shape'])}, "
                            f"model shape {tuple(v.shape)}")
    extra = [saved[k]["path"] for k in saved if k not in variables
             and (keys is None or k.split(".")[0] in {x.split(".")[0] for x in keys})]
    if extra:
        problems.append(f"the checkpoint has variables the model lacks: {extra[:5]}"
                        f"{' ...' if len(extra) > 5 else ''}")
    if problems:
        raise ValueError(
            f"The checkpoint {step_dir} does not fit this model: " + "; ".join(problems[:8])
            + ("; ..." if len(problems) > 8 else "")
            + ". Build the model with the checkpoint's preset/config (see 'kdist inspect "
            f"{Path(step_dir).parent}'), or use another checkpoint directory."
        )


def read_arrays(step_dir, variables, keys):
    """The arrays of ``keys``, placed in the current variables' shardings (resharding)."""

    def target(v):
        value = v.value
        sharding = getattr(value, "sharding", None)
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)

    saved = read_metadata(step_dir)["variables"]
    direct = [k for k in keys if k in saved
              and tuple(saved[k]["shape"]) == tuple(variables[k].shape)]
    out = restore_tree(step_dir, {k: target(variables[k]) for k in direct}) if direct else {}
    conversion = layer_layout.plan(saved, variables, keys)
    if conversion:  # stacked <-> unstacked blocks (check_compatible allowed it)
        layer_layout.warn_rng(saved, {k: variables[k] for k in keys})
        out.update(layer_layout.read_converted(step_dir, saved, variables, conversion,
                                               restore_tree))
    return out


def restore_tree(step_dir, tree):
    """Reads the arrays named in ``tree`` (``ShapeDtypeStruct`` leaves with shardings)."""
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as checkpointer:
        return checkpointer.restore(Path(step_dir) / ITEM_DIR, args=ocp.args.PyTreeRestore(
            tree, restore_args=ocp.checkpoint_utils.construct_restore_args(tree),
            partial_restore=True))

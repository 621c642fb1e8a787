"""The model a plan is of: a kdist preset (rebuilt with the remat asked for) or a function
returning a Keras model, and its cost model (``kdist.models.cost.CostModel``) where it has
one — read from a preset's config, or from the model built abstractly (nothing allocated).

Example:
    >>> name, _, cost, length = resolve_model("gpt-nano", None, None, None)
    >>> name, length, cost.parameters > 0
    ('gpt-nano', 256, True)
"""

from __future__ import annotations

from typing import Any

import keras

from kdist.planning.compile import build_abstract
from kdist.planning.estimate import preset_backbone_config


def resolve_model(model, overrides, batch, sequence_length):
    """``(name, model_fn, cost model or None, sequence_length)``; for a preset, ``model_fn``
    takes ``remat`` and returns the builder."""
    if isinstance(model, str):
        from kdist.models import task_for_preset
        from kdist.models.base import constructor_arguments

        task = task_for_preset(model)
        # The task's own arguments (e.g. head_matmul_precision) go to it in from_preset;
        # the others override the backbone's preset fields.
        config = preset_backbone_config(model, **{
            k: v for k, v in (overrides or {}).items()
            if k not in constructor_arguments(task)})
        sequence_length = sequence_length or config["max_sequence_length"]
        if sequence_length > config["max_sequence_length"]:
            raise ValueError(f"sequence_length={sequence_length} exceeds {model}'s "
                             f"max_sequence_length {config['max_sequence_length']}.")

        def builder(remat):
            return lambda: task.from_preset(model, remat=remat, **(overrides or {}))

        return model, builder, task.cost_model_for(config), sequence_length
    if callable(model):
        if batch is None and sequence_length is None:
            raise ValueError("For a model function, pass batch=(x, y) of one micro-batch or "
                             "sequence_length (token-id inputs and targets).")
        return getattr(model, "__name__", "model"), model, None, sequence_length
    raise TypeError(f"model must be a preset name or a function returning a Keras model; "
                    f"got {type(model).__name__}.")


def task_cost_model(model_obj) -> Any:
    """The built model's cost model, or None if it has none (e.g. a keras-hub model)."""
    return model_obj.cost_model() if callable(getattr(model_obj, "cost_model", None)) else None


def cost_of_function(model_fn) -> Any:
    """Builds ``model_fn()`` abstractly (nothing allocated) to ask it for its cost model."""
    previous_policy = keras.config.dtype_policy()
    previous_dist = keras.distribution.distribution()
    keras.utils.clear_session()
    try:
        keras.distribution.set_distribution(None)
        return task_cost_model(build_abstract(model_fn, None))
    finally:
        keras.utils.clear_session()
        keras.config.set_dtype_policy(previous_policy)
        keras.distribution.set_distribution(previous_dist)

"""AdamW as pretraining recipes use it, built from Keras' own optimizer and schedule.

* learning rate: linear warmup from 0 to ``learning_rate`` over ``warmup_steps``, then
  cosine decay to ``min_learning_rate_ratio * learning_rate`` at ``decay_steps``
  (``keras.optimizers.schedules.CosineDecay`` with its warmup);
* decoupled weight decay on matrices only: biases, norm scales/offsets and embeddings are
  excluded by variable name (``NO_DECAY_NAMES``, matched with ``re.search`` by Keras);
* global-norm gradient clipping (``global_clipnorm``);
* gradient accumulation: Keras' ``gradient_accumulation_steps`` — each ``fit`` step is then
  a micro-batch, the update is applied every N steps with the mean gradient, and
  ``optimizer.iterations`` counts updates.

Where Keras falls short: with gradient accumulation, Keras 3.15 evaluates a learning-rate
schedule at the raw micro-step counter, not at the update count
(``optimizer.iterations``), so warmup and decay run N times too fast. :class:`AdamW` fixes
that; nothing else differs from ``keras.optimizers.AdamW``.
"""

from __future__ import annotations

import math
import numbers

import keras

from kdist import _keras_compat
from kdist.models import stacking

# Variable names (the last path component) that get no weight decay.
NO_DECAY_NAMES = ("bias", "gamma", "beta", "embeddings")


@keras.saving.register_keras_serializable(package="kdist")
@_keras_compat.schedule_at_update_count
class AdamW(keras.optimizers.AdamW):
    """``keras.optimizers.AdamW`` whose schedule counts optimizer updates, not micro-batches.

    Its slots of a scanned layer stack load from a ``.keras`` file saved under other
    circular pipeline repeats (``(L, ...)`` vs ``(R, L / R, ...)``): the same values, viewed
    with the stack's current shape.

    Example:
        >>> opt = AdamW(learning_rate=warmup_cosine(1.0, 10, 100), gradient_accumulation_steps=4)
    """

    def load_own_variables(self, store):
        if len(store.keys()) == len(self.variables):
            store = {str(i): stacking.reviewed(store[str(i)], v.shape)
                     for i, v in enumerate(self.variables)}
        super().load_own_variables(store)


def _check_number(name: str, value, low: float, high: float = math.inf,
                  low_open: bool = False, high_open: bool = True, example=None) -> None:
    """``ValueError`` (naming ``name``) unless ``value`` is a finite real in the interval."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number; got {value!r} ({type(value).__name__}).")
    inside = (value > low if low_open else value >= low) and (
        value < high if high_open else value <= high)
    if not math.isfinite(value) or not inside:
        interval = (f"{'(' if low_open else '['}{low:g}, "
                    f"{'inf' if high == math.inf else f'{high:g}'}{')' if high_open else ']'}")
        raise ValueError(
            f"{name} must be a finite number in {interval}; got {value!r}."
            + (f" Pass e.g. {name}={example}." if example is not None else "")
        )


def _check_int(name: str, value, minimum: int, example=None) -> None:
    """``ValueError`` (naming ``name``) unless ``value`` is an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(
            f"{name} must be an integer >= {minimum}; got {value!r}."
            + (f" Pass e.g. {name}={example}." if example is not None else "")
        )


def warmup_cosine(
    learning_rate: float,
    warmup_steps: int,
    decay_steps: int,
    min_learning_rate_ratio: float = 0.1,
) -> keras.optimizers.schedules.CosineDecay:
    """Linear warmup to ``learning_rate``, then cosine decay over ``decay_steps`` updates.

    Example:
        >>> schedule = warmup_cosine(1e-3, warmup_steps=10, decay_steps=100)
        >>> float(schedule(10))
        0.001
    """
    _check_number("learning_rate", learning_rate, 0, low_open=True, example=3e-4)
    _check_int("warmup_steps", warmup_steps, 0, example=100)
    _check_int("decay_steps", decay_steps, 1, example=2000)
    _check_number("min_learning_rate_ratio", min_learning_rate_ratio, 0, 1, high_open=False,
                  example=0.1)
    return keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0 if warmup_steps else learning_rate,
        decay_steps=decay_steps,
        alpha=min_learning_rate_ratio,
        warmup_target=learning_rate if warmup_steps else None,
        warmup_steps=warmup_steps,
    )


def adamw(
    learning_rate: float = 3e-4,
    warmup_steps: int = 100,
    decay_steps: int = 2000,
    min_learning_rate_ratio: float = 0.1,
    weight_decay: float = 0.1,
    beta_1: float = 0.9,
    beta_2: float = 0.95,
    epsilon: float = 1e-8,
    clipnorm: float | None = 1.0,
    gradient_accumulation_steps: int | None = None,
) -> AdamW:
    """A Keras ``AdamW`` with warmup + cosine schedule, decay mask and clipping.

    ``decay_steps`` counts optimizer updates (after warmup), not micro-batches. Every
    argument is checked: a learning rate that is not a finite positive number, a negative
    warmup, ``decay_steps < 1``, betas outside ``[0, 1)``, a non-positive epsilon or clip norm
    raise ``ValueError`` naming the argument (Keras would accept most and train on NaN).

    Example:
        >>> opt = adamw(3e-4, warmup_steps=100, decay_steps=2000, gradient_accumulation_steps=4)
        >>> opt.gradient_accumulation_steps
        4
    """
    if gradient_accumulation_steps is not None and (
            isinstance(gradient_accumulation_steps, bool)
            or not isinstance(gradient_accumulation_steps, numbers.Integral)
            or gradient_accumulation_steps < 1):
        raise ValueError(
            f"gradient_accumulation_steps must be a positive integer or None; got "
            f"{gradient_accumulation_steps!r}."
        )
    _check_number("weight_decay", weight_decay, 0, example=0.1)
    _check_number("beta_1", beta_1, 0, 1, example=0.9)
    _check_number("beta_2", beta_2, 0, 1, example=0.95)
    _check_number("epsilon", epsilon, 0, low_open=True, example=1e-8)
    if clipnorm is not None:
        _check_number("clipnorm", clipnorm, 0, low_open=True, example=1.0)
    optimizer = AdamW(
        learning_rate=warmup_cosine(learning_rate, warmup_steps, decay_steps,
                                    min_learning_rate_ratio),
        weight_decay=weight_decay,
        beta_1=beta_1,
        beta_2=beta_2,
        epsilon=epsilon,
        global_clipnorm=clipnorm,
        gradient_accumulation_steps=(
            gradient_accumulation_steps if (gradient_accumulation_steps or 1) > 1 else None
        ),
    )
    optimizer.exclude_from_weight_decay(var_names=list(NO_DECAY_NAMES))
    return optimizer

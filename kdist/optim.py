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
schedule at the raw micro-step counter (``optimizer._iterations``), not at the update count
(``optimizer.iterations``), so warmup and decay run N times too fast. :class:`AdamW` fixes
that; nothing else differs from ``keras.optimizers.AdamW``.
"""

from __future__ import annotations

import keras

# Variable names (the last path component) that get no weight decay.
NO_DECAY_NAMES = ("bias", "gamma", "beta", "embeddings")


@keras.saving.register_keras_serializable(package="kdist")
class AdamW(keras.optimizers.AdamW):
    """``keras.optimizers.AdamW`` whose schedule counts optimizer updates, not micro-batches.

    Example:
        >>> opt = AdamW(learning_rate=warmup_cosine(1.0, 10, 100), gradient_accumulation_steps=4)
    """

    def _get_current_learning_rate(self):
        if isinstance(self._learning_rate, keras.optimizers.schedules.LearningRateSchedule):
            return self._learning_rate(self.iterations)
        return super()._get_current_learning_rate()


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
    if warmup_steps < 0 or decay_steps < 1:
        raise ValueError(
            f"warmup_steps must be >= 0 and decay_steps >= 1; got warmup_steps={warmup_steps}, "
            f"decay_steps={decay_steps}."
        )
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

    ``decay_steps`` counts optimizer updates (after warmup), not micro-batches.

    Example:
        >>> opt = adamw(3e-4, warmup_steps=100, decay_steps=2000, gradient_accumulation_steps=4)
        >>> opt.gradient_accumulation_steps
        4
    """
    if gradient_accumulation_steps is not None and gradient_accumulation_steps < 1:
        raise ValueError(
            f"gradient_accumulation_steps must be a positive integer or None; got "
            f"{gradient_accumulation_steps}."
        )
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

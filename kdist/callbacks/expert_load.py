"""A Mixture of Experts' balance where a run's figures are read.

- ``ExpertLoad``: in the epoch's logs (the progress bar, ``CSVLogger``'s log.csv,
  TensorBoard): over every MoE layer, the smallest and largest expert's share of the last
  training batch's assignments (balanced: both 1/E) and the assignments the capacity
  dropped (0 when dropless). Per layer: :func:`kdist.models.moe_load.expert_load`. It reads the
  model's variables once per epoch end (a state sync on JAX), never per batch.
- :class:`IntervalExpertLoad`: per MoE layer, in each interval row of
  :class:`kdist.callbacks.Throughput`'s ``throughput.jsonl``, read from the trainer's live
  state when the row is written (no state sync; a device read once per interval).
- :func:`load_lines`: those rows in ``kdist report``.

Example:
    >>> log = keras.callbacks.CSVLogger("log.csv")
    >>> model.fit(data, callbacks=[ExpertLoad(), log])  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import keras
import numpy as np

from kdist import _keras_compat
from kdist.models.moe import MoEFeedForward  # noqa: F401 (examples)
from kdist.models.moe_load import expert_load, statistics


class ExpertLoad(keras.callbacks.Callback):
    """Adds ``moe_min_share``, ``moe_max_share`` and ``moe_dropped`` to each epoch's logs
    (put it before the callbacks that write them). A model without experts adds nothing."""

    def on_epoch_end(self, epoch, logs=None):
        load = expert_load(self.model)
        if logs is None or not load:
            return
        logs["moe_min_share"] = min(v["min_share"] for v in load.values())
        logs["moe_max_share"] = max(v["max_share"] for v in load.values())
        logs["moe_dropped"] = sum(v["dropped_tokens"] for v in load.values())


class IntervalExpertLoad:
    """The ``expert_load`` field of an interval row: per MoE layer of ``model`` (by path),
    the latest training batch's ``min_share``, ``max_share``, ``dropped_tokens`` and the
    layer's ``experts`` (E). :meth:`row` reads the layers' ``expert_load`` and
    ``dropped_tokens`` variables from the trainer's state as it is when called (inside
    ``fit``: the last step dispatched), reduced on the device: call it once per interval.
    Every process calls it (a collective read of sharded values on several hosts).

    Example:
        >>> layer = MoEFeedForward(num_experts=2, experts_per_token=1, expert_dim=4)
        >>> model = keras.Sequential([keras.Input((3, 8)), layer])
        >>> _ = layer(np.ones((1, 3, 8), "float32"), training=True)
        >>> IntervalExpertLoad(model).row()["expert_load"][layer.path]["max_share"]
        1.0
    """

    def __init__(self, model):
        self._model = model
        self._layers = statistics(model)  # (path, experts, load, dropped, row in a stack)
        index = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
        # The state's non-trainable values to read (a scanned stack's once for all its
        # layers): found once, at train begin, so that a row costs no walk over the model.
        variables = {id(v): v for _, _, *pair, _ in self._layers for v in pair}
        self._indices = [index[key] for key in variables]
        self._position = {key: i for i, key in enumerate(variables)}

    def row(self) -> dict[str, Any]:
        """``{"expert_load": {path: {...}}}``, or ``{}`` for a model without experts."""
        if not self._layers:
            return {}
        values = _keras_compat.live_non_trainable_values(self._model, self._indices)

        def value(variable, row):
            v = values[self._position[id(variable)]]
            return v if row is None else v[row]

        figures = np.asarray(jnp.stack([
            jnp.stack([jnp.min(value(load, row)), jnp.max(value(load, row)),
                       value(dropped, row)])
            for _, _, load, dropped, row in self._layers]))
        return {"expert_load": {
            path: {"min_share": float(low), "max_share": float(high),
                   "dropped_tokens": float(dropped), "experts": experts}
            for (path, experts, *_), (low, high, dropped) in zip(self._layers, figures)}}


def load_lines(intervals: list[dict[str, Any]]) -> list[str]:
    """The report's lines: per MoE layer, the last interval's expert load; none for a run
    without experts.

    Example:
        >>> for line in load_lines([{"step": 40, "expert_load": {"block_0/mlp": {
        ...         "min_share": 0.1, "max_share": 0.2, "dropped_tokens": 0.0,
        ...         "experts": 8}}}]):
        ...     print(line)
        expert load (interval ending at step 40; balanced: each expert 1/E of the assignments):
          block_0/mlp: 8 experts, share min 0.100 / max 0.200 (balanced 0.125), 0 dropped
    """
    last = next((r for r in reversed(intervals) if r.get("expert_load")), None)
    if last is None:
        return []
    out = [f"expert load (interval ending at step {last['step']}; balanced: each expert "
           f"1/E of the assignments):"]
    for path, v in last["expert_load"].items():
        out.append(f"  {path}: {v['experts']} experts, share min {v['min_share']:.3f} / max "
                   f"{v['max_share']:.3f} (balanced {1 / v['experts']:.3f}), "
                   f"{v['dropped_tokens']:.0f} dropped")
    return out

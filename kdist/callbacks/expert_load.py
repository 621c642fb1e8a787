"""``ExpertLoad``: a Mixture of Experts' balance in the epoch's logs (the progress bar,
``CSVLogger``'s log.csv, TensorBoard): over every MoE layer, the smallest and largest
expert's share of the last training batch's assignments (balanced: both 1/E) and the
assignments the capacity dropped (0 when dropless). Per layer:
:func:`kdist.models.moe.expert_load`.

It reads the model's variables once per epoch end (a state sync on JAX), never per batch.

Example:
    >>> log = keras.callbacks.CSVLogger("log.csv")
    >>> model.fit(data, callbacks=[ExpertLoad(), log])  # doctest: +SKIP
"""

from __future__ import annotations

import keras

from kdist.models.moe import expert_load


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

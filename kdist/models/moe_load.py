"""Where a model's Mixture-of-Experts layers keep their last batch's load, and reading it:
:func:`statistics` finds each layer's variables (a scanned stack's rows too),
:func:`expert_load` reads their min/max share and dropped count (the Throughput log's
and ``kdist report``'s per-layer load).

Example:
    >>> layer = MoEFeedForward(num_experts=2, experts_per_token=1, expert_dim=4)
    >>> _ = layer(keras.ops.ones((1, 4, 8)))
    >>> sorted(expert_load(layer)[layer.path])
    ['dropped_tokens', 'max_share', 'min_share']
"""

from __future__ import annotations

import keras  # noqa: F401 (the examples')
from keras import ops

from kdist import _keras_compat
from kdist.models import stacking
from kdist.models.moe import MoEFeedForward
from kdist.models.scan import LayerStack


def statistics(model) -> list[tuple[str, int, object, object, int | None]]:
    """Where each MoE layer of ``model`` keeps its last batch's load: ``(path, experts,
    load variable, dropped variable, index)`` — an unstacked layer's own variables
    (``index`` None), or, for each layer of a scanned stack
    (:class:`~kdist.models.scan.LayerStack`), the stack's ``(L, ...)`` variables and the
    layer's row in them (its path as the unstacked layer's, ``block_3/moe``).

    Example:
        >>> layer = MoEFeedForward(num_experts=2, experts_per_token=1, expert_dim=4,
        ...                        name="moe")
        >>> _ = layer(keras.ops.ones((1, 4, 8)))
        >>> [(path, e, index) for path, e, _, _, index in statistics(layer)]
        [('moe', 2, None)]
    """
    found = []
    for layer in _keras_compat.all_layers(model):
        if isinstance(layer, MoEFeedForward) and layer.built:
            found.append((layer.path, layer.num_experts, layer.load, layer.dropped, None))
        if not (isinstance(layer, LayerStack) and layer.built):
            continue
        for inner in _keras_compat.all_layers(layer.block):  # the stack's template block
            if isinstance(inner, MoEFeedForward):
                load, dropped = (layer.stacked_state_of(v) for v in (inner.load, inner.dropped))
                relative = inner.path.split(f"{layer.block.name}/", 1)[-1]  # moe
                found += [(stacking.unstacked_key(f"{layer.path}/{relative}", i),
                           inner.num_experts, load, dropped, i)
                          for i in range(layer.num_layers)]
    return found


def expert_load(model) -> dict[str, dict[str, float]]:
    """Per MoE layer of ``model`` (by path), the last batch's load: the smallest and largest
    expert's share of the assignments (balanced: both ``1/E``) and the dropped count.
    Reads variables: call it between steps (a callback's epoch end), not every batch.

    Example:
        >>> layer = MoEFeedForward(num_experts=2, experts_per_token=1, expert_dim=4)
        >>> _ = layer(keras.ops.ones((1, 4, 8)))
        >>> expert_load(layer)[layer.path]["dropped_tokens"]
        0.0
    """
    found = {}
    for path, _, load, dropped, index in statistics(model):
        load, dropped = (ops.convert_to_numpy(v) for v in (load, dropped))
        if index is not None:
            load, dropped = load[index], dropped[index]
        found[path] = {"min_share": float(load.min()), "max_share": float(load.max()),
                       "dropped_tokens": float(dropped)}
    return found

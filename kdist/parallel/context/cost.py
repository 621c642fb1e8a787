"""What context-parallel attention costs: each device's attention tiles and the bytes it sends.

Counted on the host from the layout, the same way the compiled program does the work
(:mod:`.attention`): ``tests/test_context.py`` checks the tile counts against the devices'
own and the bytes against the compiled step's collectives.
"""

from __future__ import annotations

import numpy as np

from kdist.parallel.context.attention import chunk_for
from kdist.parallel.context.token_layout import SequenceLayout


def tile_counts(layout: SequenceLayout, chunk_size: int | None = None,
                causal: bool = True) -> np.ndarray:
    """(Query tile, key chunk) pairs each device computes, counted on the host from the
    layout: ``(n,)``. Causal attention skips the pairs wholly in the future.

    Example:
        >>> tile_counts(SequenceLayout(64, 8, balanced=False), 8).tolist()
        [1, 2, 3, 4, 5, 6, 7, 8]
        >>> tile_counts(SequenceLayout(64, 8, balanced=False), 4).tolist()
        [3, 7, 11, 15, 19, 23, 27, 31]
        >>> tile_counts(SequenceLayout(64, 8, balanced=True), 4).tolist()
        [17, 17, 17, 17, 17, 17, 17, 17]
    """
    chunk = chunk_for(layout, chunk_size)
    keys = layout.order().reshape(-1, chunk)[:, 0]  # each chunk's first position
    counts = []
    for positions in layout.table():
        tiles = positions.reshape(-1, chunk)[:, -1]  # each tile's last position
        counts.append(int(sum((keys <= last).sum() if causal else len(keys)
                              for last in tiles)))
    return np.array(counts)


def ring_bytes(layout: SequenceLayout, batch: int, kv_heads: int, head_dim: int,
               itemsize: int) -> dict[str, float]:
    """Bytes one device sends per layer and training step with ring attention.

    Forward ``2(n-1)`` key/value blocks of ``batch x T/n x kv_heads x head_dim``;
    backward ``2(n-1)`` blocks again and ``2n`` float32 gradient blocks.

    Example:
        >>> ring_bytes(SequenceLayout(64, 8, True), 1, 2, 8, 4)["total"]
        22528.0
    """
    n = layout.devices
    block = batch * layout.local_length * kv_heads * head_dim
    forward = 2 * (n - 1) * block * itemsize
    backward = 2 * (n - 1) * block * itemsize + 2 * n * block * 4
    return {"forward": float(forward), "backward": float(backward),
            "total": float(forward + backward)}


def attention_flops(layout: SequenceLayout, batch: int, heads: int, head_dim: int,
                    chunk_size: int | None = None, causal: bool = True) -> np.ndarray:
    """Forward attention FLOPs each device computes, ``(n,)``: its tiles
    (:func:`tile_counts`) of ``chunk x chunk`` query-key pairs, ``4 H`` FLOPs per pair and
    head (``Q K^T`` and ``P V``). The backward pass does 2.5x as much on the same tiles.

    Example:
        >>> attention_flops(SequenceLayout(64, 8, True), 1, 1, 1).tolist()
        [1088, 1088, 1088, 1088, 1088, 1088, 1088, 1088]
    """
    chunk = chunk_for(layout, chunk_size)
    pairs = chunk * chunk
    return tile_counts(layout, chunk_size, causal) * pairs * 4 * batch * heads * head_dim


def causal_pairs(layout: SequenceLayout) -> np.ndarray:
    """Query-key pairs each device's causal mask leaves visible, ``(n,)``: the work an
    exact kernel (no tiles) would do.

    Example:
        >>> causal_pairs(SequenceLayout(8, 2, False)).tolist()
        [10, 26]
    """
    return np.array([int((positions[:, None] >= np.arange(layout.length)[None]).sum())
                     for positions in layout.table()])

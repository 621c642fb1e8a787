"""What context-parallel attention costs: each device's attention tiles and the bytes it sends.

Counted on the host from the layout, the same way the compiled program does the work
(:mod:`.attention`): ``tests/test_context.py`` checks the tile counts against the devices'
own and the bytes against the compiled step's collectives.
"""

from __future__ import annotations

import numpy as np

from kdist.parallel.context.attention import chunk_for
from kdist.parallel.context.layout import SequenceLayout


def tile_counts(layout: SequenceLayout, chunk_size: int | None = None,
                causal: bool = True) -> np.ndarray:
    """Tiles each device computes, counted on the host from the layout: ``(n,)``.

    Example:
        >>> tile_counts(SequenceLayout(64, 8, balanced=False)).tolist()
        [1, 2, 3, 4, 5, 6, 7, 8]
        >>> tile_counts(SequenceLayout(64, 8, balanced=True)).tolist()
        [17, 17, 17, 17, 17, 17, 17, 17]
    """
    chunk = chunk_for(layout, chunk_size)
    keys = layout.order().reshape(-1, chunk)[:, 0]  # each chunk's first position
    counts = []
    for positions in layout.table():
        runs = positions.reshape(layout.runs, -1)[:, -1]  # each run's last position
        counts.append(int(sum((keys <= last).sum() if causal else len(keys)
                              for last in runs)))
    return np.array(counts)


def ring_bytes(layout: SequenceLayout, batch: int, kv_heads: int, head_dim: int,
               itemsize: int) -> dict[str, float]:
    """Bytes one device sends per layer and training step with ring attention.

    Forward ``2(n-1)`` key/value blocks of ``batch x T/n x kv_heads x head_dim``;
    backward ``2(n-1)`` blocks again and ``2n`` float32 gradient blocks.

    Example:
        >>> ring_bytes(SequenceLayout(64, 8, True), 1, 2, 8, 4)["total"]
        16384.0
    """
    n = layout.devices
    block = batch * layout.local_length * kv_heads * head_dim
    forward = 2 * (n - 1) * block * itemsize
    backward = 2 * (n - 1) * block * itemsize + 2 * n * block * 4
    return {"forward": float(forward), "backward": float(backward),
            "total": float(forward + backward)}

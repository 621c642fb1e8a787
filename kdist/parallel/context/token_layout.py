"""Which tokens of a sequence each device of the ``seq`` axis holds, and their positions.

A sequence of T tokens split over n devices: device i holds ``T / n`` of them. *Contiguous*:
tokens ``i T/n ... (i+1) T/n - 1``. *Balanced* (the "zigzag" of Megatron-LM's and MaxText's
load-balanced context parallelism): the sequence is cut into 2n chunks of ``T / 2n`` and
device i holds chunks i and 2n-1-i, so under causal attention every device has the same
number of (query, earlier key) pairs — an early chunk's few with a late chunk's many.

The model computes on the tokens in *layout order* (device 0's tokens, then device 1's,
...), so the activations ``(B, T, D)`` split contiguously over ``seq`` give each device its
own tokens. Everything that depends on a token's position reads it here, never from
``arange(T)``: learned and rotary positions (:func:`token_positions`), document positions
(:func:`document_positions`) and the causal mask (:mod:`.attention`).

The training step sets the layout (:func:`sequence_layout`); elsewhere (``predict``, a
user's own loop) a sequence that divides by the ``seq`` axis is split contiguously.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kdist.parallel import region
from kdist.parallel.layout import active

AXIS = "seq"


def seq_size() -> int:
    """Devices on the ``seq`` axis of the active kdist distribution (1 without one)."""
    dist = active()
    return dist.mesh_shape.get(AXIS, 1) if dist is not None else 1


def valid_lengths(devices: int, balanced: bool, around: int, count: int = 2) -> list[int]:
    """Sequence lengths near ``around`` that split over ``devices`` (``2 x devices`` chunks
    when ``balanced``), for error messages.

    Example:
        >>> valid_lengths(8, True, 100)
        [96, 112]
    """
    unit = 2 * devices if balanced else devices
    below = max(unit, around // unit * unit)
    return sorted({below, below + unit} if below != around else {around})[:count]


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """The split of a sequence of ``length`` tokens over ``devices`` devices.

    Example:
        >>> SequenceLayout(8, 2, balanced=True).order().tolist()
        [0, 1, 6, 7, 2, 3, 4, 5]
        >>> SequenceLayout(8, 2, balanced=False).table().tolist()
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    """

    length: int
    devices: int
    balanced: bool

    def __post_init__(self):
        unit = 2 * self.devices if self.balanced else self.devices
        if self.length % unit:
            why = (f"load balancing cuts each sequence into 2 x seq = {unit} equal chunks"
                   if self.balanced else f"each of the {self.devices} 'seq' devices holds "
                   f"an equal share")
            fix = " or load_balance=False" if self.balanced else ""
            near = " or ".join(map(str, valid_lengths(self.devices, self.balanced, self.length)))
            raise ValueError(
                f"Sequence length {self.length} does not divide by {unit}: {why}. Use a "
                f"multiple of {unit} (e.g. {near}), another 'seq' size{fix}.")

    @property
    def local_length(self) -> int:
        """Tokens per device."""
        return self.length // self.devices

    @property
    def runs(self) -> int:
        """Contiguous runs of positions per device: 2 balanced (the two chunks), else 1."""
        return 2 if self.balanced else 1

    def order(self) -> np.ndarray:
        """``(T,)``: the true position of each token in layout order."""
        n, t = self.devices, self.length
        if not self.balanced:
            return np.arange(t)
        chunks = np.arange(t).reshape(2 * n, t // (2 * n))
        return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]])
                               for i in range(n)])

    def inverse(self) -> np.ndarray:
        """``(T,)``: where each true position sits in layout order."""
        return np.argsort(self.order())

    def table(self) -> np.ndarray:
        """``(n, T / n)``: the true positions each device holds."""
        return self.order().reshape(self.devices, self.local_length)

    def local_positions(self):
        """Inside the per-device region: this device's true positions ``(T / n,)``."""
        return jnp.asarray(self.table(), jnp.int32)[jax.lax.axis_index(AXIS)]


@contextlib.contextmanager
def sequence_layout(layout: SequenceLayout | None):
    """Sets the layout of the sequences being traced (the training step does).

    Example:
        >>> with sequence_layout(SequenceLayout(16, 8, balanced=True)):
        ...     pass
    """
    with region.entered(region.current().with_sequence(layout)):
        yield


def step_layout() -> SequenceLayout | None:
    """The layout the training step set (in the region being traced), or None."""
    return region.current().sequence


def current_layout(length) -> SequenceLayout | None:
    """The layout of a sequence of ``length`` tokens being traced, or None when it is not
    split: no ``seq`` axis, a length the axis does not divide, or (per device) no step
    layout. Inside the per-device region ``length`` is one device's share.
    """
    n = seq_size()
    if n == 1 or not isinstance(length, int):
        return None
    layout = step_layout()
    if region.current().tokens_split:
        return layout if layout is not None and layout.local_length == length else None
    if layout is not None and layout.length == length:
        return layout
    return SequenceLayout(length, n, balanced=False) if length % n == 0 else None


def token_positions(length):
    """True positions ``(length,)`` of the tokens a layer sees, or None when they are
    ``0 ... length - 1`` (no split, or a contiguous split of the whole sequence).

    Example:
        >>> token_positions(16) is None  # no seq axis active
        True
    """
    layout = current_layout(length)
    if layout is None:
        return None
    if region.current().tokens_split:
        return layout.local_positions()
    return jnp.asarray(layout.order(), jnp.int32) if layout.balanced else None


def all_tokens(x):
    """``(B, T, ...)`` of every token, in layout order, from a layer's ``(B, L, ...)``: the
    all-gather over ``seq`` of each device's share inside the per-device region, else ``x``
    itself (the whole sequence)."""
    if x is None or not region.current().tokens_split:
        return x
    return jax.lax.all_gather(x, AXIS, axis=1, tiled=True)


def document_positions(segment_ids, layout: SequenceLayout):
    """Per-document positions ``(B, L)`` of the tokens a layer sees, from their segment ids
    ``(B, L)`` (non-decreasing within each row, in true order): each token's true position
    minus that of its document's first token.

    The same values as :func:`kdist.models.layers.document_mask_and_positions` (which counts
    the tokens of earlier documents, ``O(T^2)``), in ``O(T)``: a running maximum of the
    document starts in true order, then back to layout order.
    """
    segments = jnp.asarray(all_tokens(segment_ids), jnp.int32)  # (B, T) layout order
    true_order = jnp.take(segments, jnp.asarray(layout.inverse()), axis=1)
    positions = jnp.arange(layout.length, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(true_order[:, :1], bool),
                              true_order[:, 1:] != true_order[:, :-1]], axis=1)
    first = jax.lax.cummax(jnp.where(starts, positions, 0), axis=1)  # (B, T)
    within = jnp.take(positions - first, jnp.asarray(layout.order()), axis=1)  # layout order
    if not region.current().tokens_split:
        return within
    start = jax.lax.axis_index(AXIS) * layout.local_length
    return jax.lax.dynamic_slice_in_dim(within, start, layout.local_length, axis=1)

"""Context parallelism: the ``seq`` mesh axis splits every sequence's tokens over devices.

Activations ``(B, T, D)`` are split over ``seq`` along T (``shard_batch`` pins them); norms,
MLPs and projections run on each device's tokens unchanged. What needs the whole sequence:

* positions — each token's true position, read from the sequence's layout
  (:mod:`.token_layout`: contiguous, or balanced "zigzag" chunks for causal models), by learned
  and rotary position embeddings and document positions;
* attention — each device's queries over every key (:mod:`.attention`: all-gather of the
  keys and values, or a ring of ``ppermute``), entered from the attention layer
  (:mod:`.layer`);
* the loss and the gradients — partial over ``seq``, summed over it like over a replica
  axis: by XLA, or by kdist's explicit reduction (:mod:`kdist.parallel.reduction`), and
  by the fused loss (:mod:`kdist.models.losses`);
* the step's transform (:mod:`.transform`) — the layout, the load-balancing reorder of the
  tokens and its undoing, and the checks of the sequence length before anything compiles.

:mod:`.cost` counts each device's attention tiles and the bytes the ring sends.

Example:
    >>> import keras, kdist
    >>> keras.distribution.set_distribution(
    ...     kdist.distribution("seq=4,data=2", context_parallel="ring"))  # doctest: +SKIP
"""

from kdist.parallel.context.attention import DEFAULT_CHUNK, local_attention
from kdist.parallel.context.layer import attention
from kdist.parallel.context.token_layout import (
    SequenceLayout,
    current_layout,
    document_positions,
    seq_size,
    token_positions,
)

__all__ = ["DEFAULT_CHUNK", "SequenceLayout", "attention", "current_layout",
           "document_positions", "local_attention", "seq_size", "token_positions"]

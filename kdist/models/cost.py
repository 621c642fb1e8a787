"""A model family's analytic cost: parameters, FLOPs per token and activation bytes per
token — what ``kdist plan``, ``kdist.flops`` and the ``Throughput`` callback read of a
family (:class:`kdist.models.base.Task.cost_model`).
"""

from __future__ import annotations

import abc


class CostModel(abc.ABC):
    """A model family's analytic cost: what ``plan``, ``flops`` and ``Throughput`` read.

    ``parameters`` counts trainable parameters (a tied table once, padding rows included:
    ``sum(np.prod(w.shape) for w in model.trainable_weights)``). FLOPs count matmuls only,
    training = 3 x forward (:class:`kdist.flops.FlopsPerToken`). Activation bytes are the
    estimate of what the backward pass keeps, per token.

    Example:
        >>> from kdist.models import GPTCausalLM
        >>> cost = GPTCausalLM.cost_model_for({"vocabulary_size": 512, "num_layers": 2,
        ...     "num_heads": 2, "hidden_dim": 32, "intermediate_dim": 64,
        ...     "max_sequence_length": 16})
        >>> cost.flops_per_token(16).training > 0 and cost.parameters > 0
        True
    """

    # The task computes its loss inside a 1F1B schedule ("scheduled_pipeline"), so the
    # planner may choose one; under 'seq' only with one target per token (choose_schedule).
    loss_in_schedule = per_token_targets = False

    @property
    @abc.abstractmethod
    def parameters(self) -> int:
        """Trainable parameters, tied weights counted once."""

    @abc.abstractmethod
    def flops_per_token(self, sequence_length: int, causal_half: bool = True):
        """Matmul FLOPs per token (a :class:`kdist.flops.FlopsPerToken`)."""

    @abc.abstractmethod
    def activation_bytes_per_token(self, sequence_length: int, bytes_per_value: int = 4,
                                   remat=False, scores_kept: bool | None = None,
                                   logits: bool = True, fused: bool = False) -> float:
        """Bytes the backward pass keeps per token (see ``GPTCostModel``'s)."""

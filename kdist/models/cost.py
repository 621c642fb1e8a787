"""A model family's analytic cost: parameters, FLOPs per token and activation bytes per
token — what ``kdist plan``, ``kdist.flops`` and the ``Throughput`` callback read of a
family (:class:`kdist.models.base.Task.cost_model`).
"""

from __future__ import annotations

import abc
from typing import NamedTuple


class Experts(NamedTuple):
    """A model's routed experts, as the planner needs them (:mod:`kdist.planning.experts`):
    ``layers`` MoE blocks of ``num_experts`` E experts, ``experts_per_token`` k each token
    goes to, ``hidden_dim`` D and ``expert_dim`` F, the ``capacity_factor`` (None:
    dropless), and ``parameters``: the routed experts' weights in every MoE block (what the
    ``expert`` mesh axis splits; the router and shared experts are not among them);
    ``matrices``: each expert's, 3 (SwiGLU: gate, up, down) or 2 (GELU: up, down);
    ``shared_dim``: the shared experts' summed width (0: none)."""

    layers: int
    num_experts: int
    experts_per_token: int
    hidden_dim: int
    expert_dim: int
    capacity_factor: float | None
    parameters: int
    matrices: int = 3
    shared_dim: int = 0


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
    # The routed experts (an :class:`Experts`), or None: a dense model, which the planner
    # never gives an 'expert' axis.
    experts: Experts | None = None

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

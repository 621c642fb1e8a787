"""Keras 3 models with logical-axes tables for the sharding rules."""

from kdist.models.gpt import GPT_LOGICAL_AXES, GPTBackbone, GPTCausalLM
from kdist.models.presets import GPT_PRESETS

__all__ = ["GPT_LOGICAL_AXES", "GPT_PRESETS", "GPTBackbone", "GPTCausalLM"]

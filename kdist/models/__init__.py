"""Keras 3 models with logical-axes tables for the sharding rules."""

from kdist.models.bert import BERT_LOGICAL_AXES, BertBackbone, BertClassifier, BertMaskedLM
from kdist.models.gpt import GPT_LOGICAL_AXES, GPTBackbone, GPTCausalLM
from kdist.models.presets import BERT_PRESETS, GPT_PRESETS
from kdist.models.pretrained import load_backbone_weights

__all__ = [
    "BERT_LOGICAL_AXES", "BERT_PRESETS", "BertBackbone", "BertClassifier", "BertMaskedLM",
    "GPT_LOGICAL_AXES", "GPT_PRESETS", "GPTBackbone", "GPTCausalLM", "load_backbone_weights",
]

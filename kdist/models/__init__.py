"""Keras 3 model families (GPT, BERT) on shared base classes, layers and cost models.

==============================  =============================================================
``base``                        ``Backbone``, ``Task`` (declared step features, the parts a
                                pipeline schedule runs), ``CostModel``
``gpt``, ``gpt_lm``, ``bert``   the families' backbones and tasks (``GPTCausalLM`` in
                                ``gpt_lm``)
``cost``                        ``CostModel``: what planning, FLOPs and throughput read of a
                                family
``gpt_cost``, ``bert_cost``     their parameters, FLOPs and activation bytes per token
``layers``, ``attention``       Transformer blocks; the attention layer (XLA, chunked, or a
                                Pallas kernel of ``kdist.kernels``)
``chunked_attention``           attention over key chunks with an online softmax (plain JAX)
``embeddings``, ``rope``        token and position embeddings; rotary positions
``losses``                      the fused (chunked) cross-entropy
``moe``, ``router``             Mixture of Experts: routed SwiGLU or GELU experts, routers
                                and load-balance losses
``moe_load``                    where MoE layers keep their last batch's load; reading it
``expert_compute``              the experts' compute: dropless (grouped or blocked) or a
                                capacity buffer
``scan``, ``stacking``          ``LayerStack`` (blocks as one scan; a pipeline's stack);
                                stacked <-> unstacked weights
``remat``                       rematerialisation policies (``remat="auto"``)
``generation``                  cached decoding, samplers
``presets``, ``pretrained``     named shapes; weights from a checkpoint or Hugging Face
``hf``                          Hugging Face checkpoints in and out
==============================  =============================================================

Example:
    >>> from kdist.models import task_for_preset
    >>> task_for_preset("gpt-nano").__name__, task_for_preset("bert-base").__name__
    ('GPTCausalLM', 'BertMaskedLM')
"""

from kdist.models.base import Backbone, Task
from kdist.models.bert import BertBackbone, BertClassifier, BertMaskedLM
from kdist.models.bert_cost import BertCostModel
from kdist.models.cost import CostModel
from kdist.models.embeddings import PositionEmbedding, SegmentEmbedding, TokenEmbedding
from kdist.models.gpt import GPTBackbone
from kdist.models.gpt_cost import GPTCostModel
from kdist.models.gpt_lm import GPTCausalLM
from kdist.models.presets import BERT_PRESETS, GPT_PRESETS
from kdist.models.pretrained import load_backbone_weights

# The task a preset name trains by default (pretraining): each family's presets table.
_PRESET_TASKS: tuple[type[Task], ...] = (GPTCausalLM, BertMaskedLM)


def task_for_preset(preset: str) -> type[Task]:
    """The task class whose backbone has the preset ``preset`` (its pretraining task).

    Example:
        >>> task_for_preset("llama-nano").__name__
        'GPTCausalLM'
    """
    for task in _PRESET_TASKS:
        if preset in task.backbone_class.presets:
            return task
    known = [name for task in _PRESET_TASKS for name in task.backbone_class.presets]
    raise ValueError(f"Unknown preset '{preset}'. Available presets: {', '.join(known)}.")


__all__ = [
    "BERT_PRESETS", "Backbone", "BertBackbone", "BertClassifier", "BertCostModel",
    "BertMaskedLM", "CostModel", "GPTBackbone", "GPTCausalLM", "GPTCostModel", "GPT_PRESETS",
    "PositionEmbedding", "SegmentEmbedding", "Task", "TokenEmbedding", "load_backbone_weights",
    "task_for_preset",
]

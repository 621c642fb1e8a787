"""The cost model of BERT with one of its heads (:class:`BertCostModel`): exact parameters,
FLOPs and activation bytes per token from a backbone config alone. Build one with
``BertMaskedLM.cost_model_for(config)`` or ``BertClassifier.cost_model_for(config)``, which
fill the constructor's defaults in."""

from __future__ import annotations

import dataclasses

from kdist import flops
from kdist.models.cost import CostModel


class BertCostModel(CostModel):
    """Parameters, FLOPs and activation bytes per token of BERT with one of its heads.

    The encoder's attention is bidirectional: the full ``T x T`` scores and values, nothing
    halved (``causal_half`` does not apply). The head is the masked-LM head (transform
    ``2 D^2`` and tied unembedding ``2 D V`` at ``masked_positions`` P of each sequence's T
    positions: a share ``P / T`` per token; None: every position) or, with
    ``num_classes``, the pooler ``2 D^2`` and classifier ``2 D C`` once per sequence.

    Example:
        >>> from kdist.models import BERT_PRESETS, BertBackbone
        >>> config = BertBackbone.full_config(BERT_PRESETS["bert-base"])
        >>> f = BertCostModel(config, masked_positions=20).flops_per_token(128)
        >>> f.causal, round(f.unembedding / (2 * 768 * 30522), 4)  # 20 of 128 positions
        (False, 0.1562)
    """

    def __init__(self, backbone_config, masked_positions: int | None = None,
                 num_classes: int | None = None):
        # ``backbone_config``: every BertBackbone argument (``BertBackbone.full_config``).
        self.config = dict(backbone_config)
        self.masked_positions = masked_positions
        self.num_classes = num_classes

    @property
    def loss_in_schedule(self) -> bool:
        """BertMaskedLM computes its loss inside a 1F1B schedule; the classifier does not."""
        return self.num_classes is None

    @property
    def parameters(self) -> int:
        """Trainable parameters (exact), the tied token table once."""
        c = self.config
        d, f, v = c["hidden_dim"], c["intermediate_dim"], c["vocabulary_size"]
        embeddings = (v + c["max_sequence_length"] + c["num_segments"]) * d + 2 * d
        block = 4 * (d * d + d) + 2 * d * f + f + d + 2 * 2 * d
        pooler = d * d + d
        if self.num_classes is not None:
            head = d * self.num_classes + self.num_classes
        else:
            head = d * d + d + 2 * d + v  # transform, its norm, the output bias
        return int(embeddings + c["num_layers"] * block + pooler + head)

    def _head_share(self, sequence_length: int) -> float:
        if self.masked_positions is None:
            return 1.0
        share = self.masked_positions / sequence_length
        if not 0 < share <= 1:
            raise ValueError(f"masked_positions must be in 1..sequence_length "
                             f"({sequence_length}); got {self.masked_positions}.")
        return share

    def flops_per_token(self, sequence_length: int, causal_half: bool = True):
        c = self.config
        d, t = c["hidden_dim"], sequence_length
        if self.num_classes is not None:
            extra, unembedding_share = (2 * d * d + 2 * d * self.num_classes) / t, 0.0
        else:
            unembedding_share = self._head_share(t)
            extra = 2 * d * d * unembedding_share
        encoder = flops.transformer_flops_per_token(
            c["num_layers"], d, c["num_heads"], c["intermediate_dim"], c["vocabulary_size"],
            sequence_length, causal=False, remat=c["remat"] in (True, "block"),
            extra_forward_flops=extra)
        return dataclasses.replace(encoder, unembedding=encoder.unembedding * unembedding_share)

    def activation_bytes_per_token(self, sequence_length: int, bytes_per_value: int = 4,
                                   remat=False, scores_kept: bool | None = None,
                                   logits: bool = True, fused: bool = False) -> float:
        """As :meth:`GPTCostModel.activation_bytes_per_token` per encoder layer (the same
        tensors, post-norm), plus the embedding sum and its norm (2D); the MLM head's
        float32 logits and their gradient (2V x 4 bytes) and transform (3D) only at the
        masked share of positions; a classifier head keeps a negligible (B, D)."""
        c = self.config
        d, f, n, v = c["hidden_dim"], c["intermediate_dim"], c["num_heads"], c["vocabulary_size"]
        if scores_kept is None:
            scores_kept = not c["attention_chunk_size"]
        attention = 2 * n * (sequence_length if scores_kept else 1)
        per_layer = bytes_per_value * (9 * d + attention + 2 * f)
        head = 0.0
        if self.num_classes is None and logits:
            head = self._head_share(sequence_length) * (2 * v * 4 + 3 * d * bytes_per_value)
        # Policies that keep more than the block input ("minimal", "save_dots") as keeping
        # everything: the cautious side.
        layers_kept = bytes_per_value * d * c["num_layers"] + per_layer \
            if remat in (True, "block") else c["num_layers"] * per_layer
        return layers_kept + 2 * d * bytes_per_value + head

"""A masked LM's default loss inside a pipeline schedule (``pipeline_schedule='1f1b'`` or
``'interleaved_1f1b'``): each microbatch's loss is computed on the last virtual stage as
soon as its forward leaves it, so that its backward can start at the next tick
(:func:`kdist.parallel.pipeline.scheduled`, :mod:`kdist.parallel.interpreter`).

``BertMaskedLM.pipeline_loss`` calls it while the training step has entered
``pipeline_loss_for(y, sample_weight)`` (the ``scheduled_pipeline`` step feature).
"""

from __future__ import annotations

import math

import keras
from keras import ops


def masked_lm_loss(lm, inputs, y, sample_weight=None):
    """The cross-entropy of ``lm``'s logits at ``inputs["mask_positions"]`` against ``y``
    ``(B, P)``, weighted by ``sample_weight`` ``(B, P)`` and divided by the weights' sum
    (without weights: by ``B P``) — what ``compile()``'s default loss computes (Keras'
    ``"mean_with_sample_weight"`` reduction). The embeddings and the padding mask are
    computed before the schedule, on every stage; the gather at the masked positions, the
    head (dense + GELU + LayerNorm, the tied table, the output bias) and the cross-entropy
    of one microbatch's float32 logits at a time inside it."""
    backbone = lm.backbone
    # Called outside Keras' functional graph, which would pass `training` on.
    hidden = backbone.embed(inputs["token_ids"], inputs["segment_ids"], training=True)
    mask = backbone.get_layer("padding_attention_mask")(inputs["padding_mask"])  # (B,1,1,T)
    gather = lm.get_layer("masked_positions")
    head_layers = (lm.transform, lm.transform_norm, backbone.token_embedding, lm.output_bias)
    head = [[ops.convert_to_tensor(v) for v in layer.trainable_variables]
            for layer in head_layers]
    if sample_weight is None:
        weights = ops.ones(y.shape, "float32")
        total = float(math.prod(y.shape))
    else:
        weights = ops.cast(sample_weight, "float32")
        total = ops.sum(weights)  # over the global batch, before the schedule
    targets = {"labels": y, "weights": weights,
               "positions": ops.cast(inputs["mask_positions"], "int32")}

    def loss_fn(head, h, t):  # (b, T, D), (b, P) each -> this microbatch's share
        transform, norm, embedding, bias = head_layers
        x = gather(h, t["positions"])  # (b, P, D)
        x, _ = transform.stateless_call(head[0], [], x)
        x, _ = norm.stateless_call(head[1], [], x)
        logits, _ = embedding.stateless_call(head[2], [], x, reverse=True)  # (b, P, V)
        logits, _ = bias.stateless_call(head[3], [], logits)
        cross_entropy = keras.losses.sparse_categorical_crossentropy(
            t["labels"], ops.cast(logits, "float32"), from_logits=True)
        return ops.sum(cross_entropy * t["weights"]) / total

    return backbone.blocks.scheduled_loss(hidden, loss_fn, head, targets, attention_mask=mask)

"""A causal LM's default loss inside a pipeline schedule (``pipeline_schedule='1f1b'`` or
``'interleaved_1f1b'``): each microbatch's loss is computed on the last virtual stage as
soon as its forward leaves it, so that its backward can start at the next tick
(:func:`kdist.parallel.pipeline.scheduled`, :mod:`kdist.parallel.interpreter`).

``GPTCausalLM.pipeline_loss`` calls it while the training step has entered
``pipeline_loss_for(y, sample_weight)`` (the ``scheduled_pipeline`` step feature).
"""

from __future__ import annotations

import math

import keras
from keras import ops

from kdist.parallel import pipeline


def causal_lm_loss(lm, inputs, y, sample_weight=None):
    """Mean token cross-entropy of ``lm`` on ``inputs`` against ``y`` ``(B, T)``: the
    embedding runs before the schedule, on every stage; the final norm, the (tied) head
    and the cross-entropy of one microbatch's float32 logits at a time inside it. Equals
    Keras' default loss (the sum over every label of the global batch over their count)."""
    if sample_weight is not None:
        raise ValueError(
            f"pipeline_schedule={pipeline.scheduled_name()!r} computes the unweighted "
            f"default loss inside the pipeline; fit() was given a sample_weight. Leave it "
            f"out, or use pipeline_schedule='gpipe'.")
    backbone = lm.backbone
    token_ids = inputs["token_ids"] if isinstance(inputs, dict) else inputs
    segments = inputs["segment_ids"] if backbone.document_mask else None
    positions = None if segments is None else backbone.get_layer(
        "document_positions")(segments)
    # Called outside Keras' functional graph, which would pass `training` on.
    hidden = backbone.embed(token_ids, positions=positions, training=True)  # (B, T, D)
    norm, embedding = backbone.final_norm, backbone.token_embedding
    head = ([ops.convert_to_tensor(v) for v in norm.trainable_variables],
            [ops.convert_to_tensor(v) for v in embedding.trainable_variables])
    tokens = math.prod(y.shape)

    def loss_fn(head, h, labels):  # (b, T, D), (b, T) -> this microbatch's share of the mean
        h, _ = norm.stateless_call(head[0], [], h)
        logits, _ = embedding.stateless_call(head[1], [], h, reverse=True)  # (b, T, V)
        cross_entropy = keras.losses.sparse_categorical_crossentropy(
            labels, ops.cast(logits, "float32"), from_logits=True)
        return ops.sum(cross_entropy) / tokens

    rotary = backbone.position_embedding is None
    return backbone.blocks.scheduled_loss(hidden, loss_fn, head, y, segment_ids=segments,
                                          positions=positions if rotary else None)

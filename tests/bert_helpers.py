"""Shared helpers of the BERT tests: a tiny BERT and deterministic masked-LM batches."""

from __future__ import annotations

import keras
import numpy as np

import kdist
from kdist.models import BertBackbone, BertMaskedLM

# A BERT small enough to compile in seconds, with every dimension divisible by 8.
TINY_BERT = dict(
    vocabulary_size=256, num_layers=2, num_heads=8, hidden_dim=64,
    intermediate_dim=128, max_sequence_length=32,
)


def tiny_bert_mlm(mesh: str | None = None, seed: int = 0, **overrides) -> BertMaskedLM:
    """Sets the distribution (None = 1 device), then builds a seeded tiny BERT MLM."""
    keras.distribution.set_distribution(kdist.distribution(mesh) if mesh else None)
    keras.utils.set_random_seed(seed)
    return BertMaskedLM(BertBackbone(**{**TINY_BERT, **overrides}))


def mlm_batches(steps: int, batch: int = 8, length: int = 16, slots: int = 4,
                vocab: int = 256, seed: int = 0):
    """Deterministic (inputs, mask_ids, mask_weights) batches with padding: each row has a
    random real length, two segments, ``slots`` masked slots of which the last is unused."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lengths = rng.integers(length // 2, length + 1, size=batch)
        real = np.arange(length) < lengths[:, None]
        token_ids = np.where(real, rng.integers(5, vocab, (batch, length)), 0).astype("int32")
        segment_ids = (real & (np.arange(length) >= lengths[:, None] // 2)).astype("int32")
        positions = np.stack([rng.choice(n, slots, replace=False) for n in lengths])
        mask_ids = np.take_along_axis(token_ids, positions, 1)
        np.put_along_axis(token_ids, positions[:, :-1], 4, 1)  # [MASK] at the used slots
        weights = np.ones((batch, slots), "float32")
        weights[:, -1] = 0.0
        inputs = {"token_ids": token_ids, "segment_ids": segment_ids,
                  "padding_mask": real.astype("int32"),
                  "mask_positions": positions.astype("int32")}
        out.append((inputs, mask_ids.astype("int32"), weights))
    return out


def train_mlm(model, batches, optimizer=None) -> list[float]:
    """Compiles (with the parity optimizer by default) and runs a step per batch."""
    from tests.helpers import parity_optimizer

    model.compile(optimizer=optimizer or parity_optimizer())
    return [float(model.train_on_batch(x, y, sample_weight=w)[0]) for x, y, w in batches]

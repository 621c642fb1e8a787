"""Shared helpers that keep each test short."""

from __future__ import annotations

import keras
import numpy as np

import kdist
from kdist.models import GPTCausalLM

# A GPT small enough to compile in seconds, with every dimension divisible by 8.
TINY_GPT = dict(
    vocabulary_size=256, num_layers=2, num_heads=8, hidden_dim=64,
    intermediate_dim=128, max_sequence_length=32,
)


def tiny_gpt(mesh: str | None = None, seed: int = 0, **overrides) -> GPTCausalLM:
    """Sets the distribution (None = 1 device), then builds a seeded tiny GPT."""
    keras.distribution.set_distribution(kdist.distribution(mesh) if mesh else None)
    keras.utils.set_random_seed(seed)
    return GPTCausalLM(kdist.models.GPTBackbone(**{**TINY_GPT, **overrides}))


def token_batches(steps: int, batch: int = 8, length: int = 16, vocab: int = 256, seed: int = 0):
    """Deterministic random (inputs, targets) batches."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(steps, batch, length + 1), dtype=np.int32)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def train(model, batches, optimizer=None) -> list[float]:
    """Compiles (AdamW by default) and runs one train step per batch; returns the losses."""
    model.compile(optimizer=optimizer or kdist.optim.adamw(1e-2, warmup_steps=1, decay_steps=10))
    return [float(model.train_on_batch(x, y)) for x, y in batches]


def weights(model) -> dict[str, np.ndarray]:
    """Every model weight gathered to the host, keyed by path."""
    return {w.path: np.asarray(w.value) for w in model.weights}

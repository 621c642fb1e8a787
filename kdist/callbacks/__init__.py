"""Keras callbacks for kdist runs (one callback per file)."""

from kdist.callbacks.checkpoint import Checkpoint, CheckpointError
from kdist.callbacks.throughput import Throughput, parse_profile_steps

__all__ = ["Checkpoint", "CheckpointError", "Throughput", "parse_profile_steps"]

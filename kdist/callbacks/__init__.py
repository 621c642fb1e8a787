"""Keras callbacks for kdist runs (one callback per file)."""

from kdist.callbacks.throughput import Throughput, parse_profile_steps

__all__ = ["Throughput", "parse_profile_steps"]

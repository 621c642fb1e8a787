"""Context parallelism (placeholder docstring)."""

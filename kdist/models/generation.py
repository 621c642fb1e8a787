"""Cached autoregressive generation for causal language models (``GPTCausalLM.generate``).

:class:`CachedGeneration` is a mixin for a task whose backbone has ``embed``, ``blocks``
(each taking ``cache``/``cache_index``), ``final_norm`` and a reversible
``token_embedding`` (the task's ``head_matmul_precision``, where it has one, quantizes
the logits as in training); the decode loop is one compiled ``while_loop`` per sampler
and shape.
The samplers are keras-hub's (the ``text`` extra, imported when ``generate`` is called).
"""

from __future__ import annotations

import functools
import itertools

import keras
import numpy as np
from keras import ops

from kdist._optional import optional_import


class CachedGeneration:
    """``generate()`` with a key/value cache, for a causal LM task (see the module docstring).

    Example:
        >>> from kdist.models import GPTCausalLM
        >>> lm = GPTCausalLM.from_preset("gpt-nano", vocabulary_size=64, num_layers=1)
        >>> lm.generate(np.zeros((1, 3), "int32"), max_length=6, sampler="greedy").shape
        (1, 6)
    """

    def call_with_cache(self, token_ids, cache, cache_index):
        """One forward pass over ``token_ids`` (B, T) at positions ``cache_index ...``.

        ``cache`` is ``(B, L, 2, S, K, H)``: keys and values of every layer. Returns
        ``(logits (B, T, V) float32, updated cache)``.
        """
        b = self.backbone
        x = b.embed(token_ids, start_index=cache_index)
        if getattr(b, "scan_layers", False):  # one scan over the stacked blocks
            x, cache = b.blocks.call_with_cache(x, cache, cache_index)
            return ops.cast(self._head(b.final_norm(x)), "float32"), cache
        caches = []
        for i, block in enumerate(b.blocks):
            x, layer_cache = block(x, cache=cache[:, i], cache_index=cache_index)
            caches.append(layer_cache)
        return ops.cast(self._head(b.final_norm(x)), "float32"), ops.stack(caches, axis=1)

    def _head(self, hidden):
        """The logits, at the task's ``head_matmul_precision`` (``"bf16"`` without one)."""
        return self.backbone.token_embedding(
            hidden, reverse=True,
            matmul_precision=getattr(self, "head_matmul_precision", "bf16"))

    def _generate_step(self, prompt, prompt_length, sampler):
        b = self.backbone
        batch, max_length = ops.shape(prompt)
        cache = ops.zeros(
            (batch, b.num_layers, 2, max_length, b.kv_heads, b.head_dim), self.compute_dtype
        )
        # Fill the cache with the prompt (positions 0 .. prompt_length - 2): the sampler
        # feeds the last prompt token itself.
        _, cache = self.call_with_cache(prompt, cache, 0)

        def next_logits(prompt, cache, index):
            token = ops.slice(prompt, [0, index - 1], [batch, 1])  # (B, 1)
            logits, cache = self.call_with_cache(token, cache, index - 1)
            return logits[:, 0], None, cache

        return sampler(next=next_logits, prompt=prompt, cache=cache, index=prompt_length)

    def generate(
        self,
        prompt_ids,
        max_length: int,
        sampler="top_k",
        seed: int | None = None,
    ) -> np.ndarray:
        """Extends ``prompt_ids`` (B, P) to ``(B, max_length)`` tokens with a key/value cache.

        ``sampler`` is a keras-hub sampler or one of ``"greedy"``, ``"top_k"`` (k=10),
        ``"top_p"`` (p=0.9), ``"random"`` (keras-hub's: ``pip install 'kdist[text]'``). With
        a ``seed`` the result is reproducible call after call; without, each call draws
        anew. Runs as one compiled program (a ``while_loop`` over decode steps, reused
        across calls with the same sampler and shapes) and works under any kdist
        distribution.

        Example:
            >>> from kdist.models import GPTCausalLM
            >>> lm = GPTCausalLM.from_preset("gpt-nano", vocabulary_size=64, num_layers=1)
            >>> lm.generate(np.zeros((1, 3), "int32"), max_length=6, sampler="greedy").shape
            (1, 6)
        """
        prompt_ids = np.asarray(prompt_ids, dtype="int32")
        if prompt_ids.ndim != 2 or prompt_ids.shape[1] < 1:
            raise ValueError(
                f"prompt_ids must be a (batch, length >= 1) int array; got shape "
                f"{prompt_ids.shape}."
            )
        prompt_length = prompt_ids.shape[1]
        if not prompt_length < max_length <= self.backbone.max_sequence_length:
            raise ValueError(
                f"max_length={max_length} must exceed the prompt length {prompt_length} and "
                f"be at most the model's max_sequence_length "
                f"{self.backbone.max_sequence_length}."
            )
        key = (sampler, seed) if isinstance(sampler, str) else id(sampler)
        if key not in self._generators:
            self._generators[key] = self._compile_generator(_make_sampler(sampler, seed))
        sampler, run = self._generators[key]
        prompt = np.zeros((prompt_ids.shape[0], max_length), "int32")
        prompt[:, :prompt_length] = prompt_ids
        out, sampler_state = run(
            prompt,
            prompt_length,
            [v.value for v in sampler.variables],
            [w.value for w in self.weights],
        )
        if seed is None:  # unseeded: advance the sampler's RNG so the next call differs
            for variable, value in zip(sampler.variables, sampler_state):
                variable.assign(value)
        return np.asarray(out)

    def _compile_generator(self, sampler):
        """The sampler and a jitted ``run(prompt, prompt_length, sampler_state, weights)``.

        Kept per sampler, so repeated calls reuse the compiled program (jax.jit retraces
        only for a new batch size, prompt length or max_length).
        """
        import jax

        @functools.partial(jax.jit, static_argnums=1)
        def run(prompt, prompt_length, sampler_state, weights):
            mapping = itertools.chain(
                zip(sampler.variables, sampler_state), zip(self.weights, weights)
            )
            with keras.StatelessScope(state_mapping=mapping) as scope:
                out = self._generate_step(prompt, prompt_length, sampler)
            return out, [scope.get_current_value(v) for v in sampler.variables]

        return sampler, run


def _make_sampler(sampler, seed):
    if not isinstance(sampler, str):
        return sampler
    keras_hub = optional_import("keras_hub", f"Generating with the {sampler!r} sampler")
    factories = {
        "greedy": lambda: keras_hub.samplers.GreedySampler(),
        "top_k": lambda: keras_hub.samplers.TopKSampler(k=10, seed=seed),
        "top_p": lambda: keras_hub.samplers.TopPSampler(p=0.9, seed=seed),
        "random": lambda: keras_hub.samplers.RandomSampler(seed=seed),
    }
    if sampler not in factories:
        raise ValueError(
            f"Unknown sampler '{sampler}'. Use one of {sorted(factories)} or pass a "
            f"keras_hub.samplers.Sampler instance."
        )
    return factories[sampler]()

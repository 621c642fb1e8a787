"""Shared helpers that keep each test short."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import keras
import numpy as np

import kdist
from kdist.models import GPTCausalLM
from tests.xla_flags import for_run_time

ROOT = Path(__file__).resolve().parents[1]  # the checkout
RECIPES = ROOT / "recipes"
FIXTURES = ROOT / "tests" / "fixtures"
# Keras' cluster variables (kdist.initialize reads them); a child starts without them.
CLUSTER_VARIABLES = ("KERAS_DISTRIBUTION_JOB_ADDRESSES", "KERAS_DISTRIBUTION_NUM_PROCESSES",
                     "KERAS_DISTRIBUTION_PROCESS_ID")

# A GPT small enough to compile in seconds, with every dimension divisible by 8.
TINY_GPT = dict(
    vocabulary_size=256, num_layers=2, num_heads=8, hidden_dim=64,
    intermediate_dim=128, max_sequence_length=32,
)
# The Llama-style variant of it: RoPE, RMSNorm, SwiGLU, 2 query heads per key/value head,
# untied output, no biases.
TINY_LLAMA = dict(
    TINY_GPT, num_key_value_heads=4, position_embedding="rotary", norm="rms_norm",
    mlp_activation="swiglu", use_bias=False, tie_embeddings=False,
)


def child_environment(**overrides: str) -> dict[str, str]:
    """The environment of every child process a test starts: this process's (so the
    compilation cache and ``$KDIST_CACHE`` of tests/conftest.py are shared), importing this
    checkout's kdist first, quiet TensorFlow, no cluster variables; then ``overrides``."""
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARIABLES}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
               TF_CPP_MIN_LOG_LEVEL="2")
    env.update(overrides)
    return env


def run_recipe(name: str, argv: list[str], host_devices: int = 8) -> tuple[dict, str]:
    """``recipes/<name>.py`` on ``host_devices`` host devices in a child process: its
    summary.json (what ``main`` returns) and its output. A child, so that XLA optimises for
    run time (tests/xla_flags.py), for the recipe tests of hundreds of steps: a BERT step of
    16 x 64 tokens takes 160 ms with the suite's compile-time flags, 90 ms with these."""
    env = child_environment()
    env["XLA_FLAGS"] = for_run_time(env.get("XLA_FLAGS", ""))
    done = subprocess.run([sys.executable, str(RECIPES / f"{name}.py"),
                           "--host-devices", str(host_devices),
                           *argv], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    summary = Path(argv[argv.index("--output-dir") + 1]) / "summary.json"
    return json.loads(summary.read_text()), done.stdout


def tiny_gpt(mesh: str | None = None, seed: int = 0, **overrides) -> GPTCausalLM:
    """Sets the distribution (None = 1 device), then builds a seeded tiny GPT."""
    keras.distribution.set_distribution(kdist.distribution(mesh) if mesh else None)
    keras.utils.set_random_seed(seed)
    return GPTCausalLM(kdist.models.GPTBackbone(**{**TINY_GPT, **overrides}))


def token_batches(steps: int, batch: int = 8, length: int = 16, vocab: int = 256, seed: int = 0):
    """Deterministic, learnable (inputs, targets) batches: each row counts up from a random
    start by a random stride of 1-3 (mod vocab), so the loss falls within a few steps."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, vocab, size=(steps, batch, 1))
    stride = rng.integers(1, 4, size=(steps, batch, 1))
    tokens = ((start + stride * np.arange(length + 1)) % vocab).astype(np.int32)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def parity_optimizer(**overrides):
    """kdist's AdamW for comparisons between two runs of the same training.

    Adam divides by ``sqrt(v) + epsilon``. For a weight whose true gradient is zero (the
    attention key bias: softmax is shift-invariant) or cancels to ~1e-9, a float32 rounding
    difference between two summation orders then becomes a full-size step, so with the usual
    epsilon=1e-8 such weights follow rounding noise. epsilon=1e-3 keeps the update a
    Lipschitz function of the gradient (constant lr/epsilon), so a comparison measures the
    computation, not Adam's amplification of rounding noise; gradients of the other weights
    are ~1e-3 and above, so the update is still Adam's.
    """
    return kdist.optim.adamw(
        **{"learning_rate": 1e-2, "warmup_steps": 1, "decay_steps": 10, "epsilon": 1e-3,
           **overrides}
    )


def train(model, batches, optimizer=None) -> list[float]:
    """Compiles (with :func:`parity_optimizer` by default) and runs a step per batch."""
    model.compile(optimizer=optimizer or parity_optimizer())
    return [float(model.train_on_batch(x, y)) for x, y in batches]


def fit_with_checkpoint(model, data, directory, *, steps_per_epoch: int, stop_at=None,
                        save_every_steps: int = 4) -> list[float]:
    """``model.fit`` over 2 epochs of ``data`` with a :class:`kdist.checkpointing.Checkpoint`
    in ``directory`` (resuming from it), stopping after step ``stop_at`` (None: the whole
    run). Returns the losses of the steps this fit ran."""
    from kdist import _keras_compat
    from kdist.checkpointing import Checkpoint

    losses = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            losses.append(logs["loss"])
            if len(losses) == stop_at:
                _keras_compat.callback_model(self).stop_training = True

    ckpt = Checkpoint(directory, data=data, verbose=False, handle_signals=False,
                      save_every_steps=save_every_steps)
    model.fit(data, epochs=2, steps_per_epoch=steps_per_epoch, shuffle=False, verbose=0,
              callbacks=[Record(), ckpt])
    return losses


def weights(model) -> dict[str, np.ndarray]:
    """Every model weight gathered to the host, keyed by path."""
    return {w.path: np.asarray(w.value) for w in model.weights}


def uncached_greedy(model, prompt: np.ndarray, max_length: int) -> np.ndarray:
    """Greedy decoding by full forward passes over a fixed-length (zero-padded) buffer:
    causal attention makes the padding invisible to earlier positions, and one shape means
    one compilation."""
    batch, length = prompt.shape
    tokens = np.zeros((batch, max_length), "int32")
    tokens[:, :length] = prompt
    for t in range(length, max_length):
        tokens[:, t] = model.predict_on_batch(tokens)[:, t - 1].argmax(-1)
    return tokens


class ProcessOutput:
    """A child process's text stdout, read line by line on a thread (an unread pipe would
    fill up and stall the child). ``wait_for`` blocks on a condition the reader signals for
    every line, with a bound; ``finish`` waits for the exit and the last line."""

    def __init__(self, proc):
        self.proc, self.lines, self._ended = proc, [], False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_for(self, predicate, timeout: float = 240):
        """Until ``predicate(lines)`` holds; fails with the output if the output ends or
        ``timeout`` seconds pass first."""
        with self._changed:
            self._changed.wait_for(lambda: self._ended or predicate(self.lines), timeout)
            assert predicate(self.lines), "".join(self.lines)

    def finish(self, timeout: float) -> tuple[int, str]:
        status = self.proc.wait(timeout=timeout)
        self._reader.join()
        return status, "".join(self.lines)


def independent_memory(model, *batch):
    """``memory_analysis()`` of the model's train step compiled here as Keras' trainer jits
    it (state donated; one device, so no output shardings), for ``batch``'s shapes: what
    :class:`kdist.compiled_step.ProgramMemory` must equal."""
    import jax

    from kdist import _keras_compat
    from kdist.compiled_step import ProgramMemory

    state = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
                         _keras_compat.jax_state(model))
    specs = tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in batch)
    compiled = jax.jit(model.train_step, donate_argnums=0).lower(state, specs).compile()
    m = compiled.memory_analysis()
    return ProgramMemory(m.argument_size_in_bytes, m.output_size_in_bytes,
                         m.alias_size_in_bytes, m.temp_size_in_bytes,
                         m.generated_code_size_in_bytes)

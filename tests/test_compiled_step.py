"""The train step compiled ahead of its first call: the same program, compiled once, whose
memory_analysis() is the one an independent compile of the step reports."""

import logging
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdist import compiled_step
from kdist.compiled_step import CompiledStep, ProgramMemory
from tests.helpers import independent_memory, parity_optimizer, tiny_gpt


class CompileLog(logging.Handler):
    """JAX's compile log (jax_log_compiles): one "Compiling jit(f)" line per compilation of
    f, whether XLA then builds it or the persistent cache serves it."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def count(self, name):
        return sum(line.startswith(f"Compiling jit({name})") for line in self.lines)


@pytest.fixture
def compile_log():
    log, logger = CompileLog(), logging.getLogger("jax")
    logger.addHandler(log)
    jax.config.update("jax_log_compiles", True)
    try:
        yield log
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(log)


def test_fit_compiles_the_step_once_and_keeps_its_memory(compile_log):
    model = tiny_gpt()
    model.compile(optimizer=parity_optimizer())
    x = np.random.default_rng(0).integers(0, 256, (40, 16)).astype("int32")
    model.fit(x, x, batch_size=8, verbose=0)  # 5 equal batches: one program
    (step,) = compiled_step.steps_of(model.train_function)
    assert step.programs == 1 and compile_log.count("train_step") == 1
    assert step.compiled[0].memory_analysis().argument_size_in_bytes == step.memory.argument
    assert step.memory == independent_memory(model, x[:8], x[:8])
    assert step.memory.peak == (step.memory.argument + step.memory.temp
                                + step.memory.output - step.memory.alias
                                + step.memory.generated_code)
    # A smaller last batch is another program, as under jit; the largest is reported.
    full = step.memory
    model.fit(x[:36], x[:36], batch_size=8, verbose=0)
    assert step.programs == 2 and compile_log.count("train_step") == 2
    assert len(step.compiled) == 2  # what ran, read without compiling again
    assert step.memory == full and full.peak > independent_memory(model, x[:4], x[:4]).peak


class Counted:
    """A jitted step whose lowerings and direct calls are counted."""

    def __init__(self, jitted):
        self.jitted, self.lowered, self.called = jitted, 0, 0

    def lower(self, *args):
        self.lowered += 1
        return self.jitted.lower(*args)

    def __call__(self, *args):
        self.called += 1
        return self.jitted(*args)


def test_each_argument_signature_compiles_once_and_is_reused():
    jitted = Counted(jax.jit(lambda state, x: (x.sum(), state * 2.0), donate_argnums=0))
    step = CompiledStep(jitted)
    state = jnp.ones(3)
    for rows in (2, 5, 5, 2):  # a second batch shape: compiled once, then reused
        logs, state = step(state, jnp.ones(rows))
        assert float(logs) == rows
    assert step.programs == 2 and jitted.lowered == 2
    # The state changed dtype: another signature, its own program (never a retry via jit).
    logs, state = step(jnp.ones(3, "bfloat16"), jnp.ones(2))
    assert state.dtype == jnp.bfloat16 and float(logs) == 2.0
    assert step.programs == 3 and jitted.lowered == 3 and jitted.called == 0


def test_a_value_error_raised_in_the_step_reaches_the_caller():
    def train_step(state, x):
        if x.shape[0] % 2:
            raise ValueError(f"the batch must have an even number of rows; got {x.shape[0]}")
        return x.sum(), state

    jitted = Counted(jax.jit(train_step))
    step = CompiledStep(jitted)
    step(jnp.ones(3), jnp.ones(2))
    with pytest.raises(ValueError, match="even number of rows; got 3"):
        step(jnp.ones(3), jnp.ones(3))
    assert step.programs == 1 and jitted.called == 0

    class Refusing:  # a program that raises when it runs: nothing retries it through jit
        def lower(self, *args):
            return self

        def compile(self):
            return self

        def memory_analysis(self):
            return None  # no figures: ProgramMemory reads zeros

        def __call__(self, *args):
            raise ValueError("raised by the step")

    refusing = Counted(Refusing())
    with pytest.raises(ValueError, match="raised by the step"):
        CompiledStep(refusing)(jnp.ones(2))
    assert refusing.lowered == 1 and refusing.called == 0


def test_a_tpu_programs_temporaries_are_the_compilers_heap_not_its_reported_figure():
    # libtpu's temp_size_in_bytes is its heap plus what it calls fragmentation, which counts
    # a loop's carried buffers a second time; peak_memory_in_bytes is the arguments plus the
    # heap (benchmarks/README.md, "The scanned step ...").
    class Device:
        platform = "tpu"

    class Sharding:
        device_set = {Device()}

    class Program:
        input_shardings = ((Sharding(),), {})

        def __init__(self, temp, peak):
            self.figures = SimpleNamespace(
                argument_size_in_bytes=100, output_size_in_bytes=100, alias_size_in_bytes=100,
                temp_size_in_bytes=temp, generated_code_size_in_bytes=0,
                peak_memory_in_bytes=peak)

        def memory_analysis(self):
            return self.figures

    memory = ProgramMemory.of(Program(temp=900, peak=700))
    assert (memory.temp, memory.reported_temp, memory.peak) == (600, 900, 700)
    assert memory == ProgramMemory(100, 100, 100, 600, 0)  # the reported figure not compared
    # A peak not above the arguments says nothing of the heap: the reported figure stands.
    assert ProgramMemory.of(Program(temp=900, peak=50)).temp == 900
    Device.platform = "cpu"  # other compilers' temporaries are their own
    assert ProgramMemory.of(Program(temp=900, peak=700)).temp == 900

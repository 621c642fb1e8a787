"""The training step compiled ahead of its first call, and what its program needs in memory.

``jax.jit`` compiles a step at its first call and keeps the executable to itself, so the
program's ``memory_analysis()`` — the only figure that includes XLA's temporaries — would
cost a second compilation (80 s for a gpt2-medium step on a TPU). :class:`CompiledStep`
compiles the same jitted function the way ``jit`` would, once per argument signature
(:func:`signature`: shapes, dtypes and shardings; ``lower(*args).compile()``, JAX's
ahead-of-time API, the persistent compilation cache included), then calls that executable
— whose dispatch is jit's own C++ fast path — and keeps its :class:`ProgramMemory`.
kdist's tasks build their train function with it (:func:`install`), and
``kdist.callbacks.Throughput`` installs it for any other Keras model; reading
:attr:`CompiledStep.memory` is a Python attribute read: no device or state sync.

Which sum is the peak (:attr:`ProgramMemory.peak`): what the runtime holds on one device
for the program — its **arguments** (the training state and the batch, resident from its
start) + its **temporaries** (every intermediate: activations, gradients, collective
buffers; one allocation, already packed by liveness by XLA's buffer assignment) + its
**outputs that are not aliased** to a donated argument (the new state written in place of
the old one is counted once, in the arguments) + its **generated code** (the program's
instructions in device memory: 32 MB for a gpt2-small step compiled for one TPU v5e chip,
145 MB for 256 chips; 0 on XLA:CPU). ``device.memory_stats()["peak_bytes_in_use"]`` is no
substitute: on a TPU it left the temporaries out (4.19 GiB reported for a program needing
13.4 GiB). XLA's ``peak_memory_in_bytes`` is not used either: for a TPU program whose loss
ran in a scan it gave 1.49 GB, the arguments alone, beside 47.1 GB of temporaries.

Example:
    >>> import jax, jax.numpy as jnp
    >>> step = CompiledStep(jax.jit(lambda state, x: (x.sum(), state + x), donate_argnums=0))
    >>> logs, state = step(jnp.zeros(4), jnp.ones(4))
    >>> step.memory.argument == 32 and step.memory.peak >= step.memory.argument
    True
"""

from __future__ import annotations

import dataclasses
from typing import Any

FIELDS = ("argument", "output", "alias", "temp", "generated_code")


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Bytes per device of one compiled program, from its ``memory_analysis()``.

    Example:
        >>> ProgramMemory(argument=100, output=90, alias=80, temp=50, generated_code=0).peak
        160
    """

    argument: int
    output: int
    alias: int
    temp: int
    generated_code: int
    # memory_analysis()'s own temp_size_in_bytes where ``temp`` is the compiler's heap (a
    # TPU's: see ``of``); not a term of the peak, not compared.
    reported_temp: int = dataclasses.field(default=0, compare=False)

    @classmethod
    def of(cls, compiled) -> ProgramMemory:
        """The figures of a ``jax.stages.Compiled`` (zeros where a backend gives none).

        On a TPU the temporaries are the compiler's heap: libtpu's ``temp_size_in_bytes``
        adds to it what its log calls fragmentation, which for a program with loops counts
        their carried buffers a second time (a scanned gpt2-small step: heap 6.14 GiB,
        reported 8.98; benchmarks/README.md). ``peak_memory_in_bytes`` is the arguments
        plus that heap; where it is not above the arguments (seen once: 1.49 GB beside
        47.1 GB of temporaries), the reported temporaries stand."""
        m = compiled.memory_analysis()
        figures = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0) for k in FIELDS}
        reported = figures["temp"]
        peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
        if _platform(compiled) == "tpu" and peak > figures["argument"]:
            figures["temp"] = min(reported, peak - figures["argument"])
        return cls(**figures, reported_temp=reported)

    @property
    def peak(self) -> int:
        """Arguments + temporaries + outputs not aliased to a donated argument + generated
        code: what the program needs on one device (see the module docstring for why)."""
        return self.argument + self.temp + (self.output - self.alias) + self.generated_code

    def row(self) -> dict[str, Any]:
        """The fields a run log row carries: ``compiled_peak_bytes`` and its terms."""
        return {"compiled_peak_bytes": self.peak,
                "compiled_memory": {k: getattr(self, k) for k in FIELDS}}


def _platform(compiled) -> str | None:
    """The platform a compiled program runs on (a TPU topology's too), None if unknown."""
    import jax

    try:
        sharding = jax.tree.leaves(compiled.input_shardings)[0]
        return next(iter(sharding.device_set)).platform
    except (AttributeError, IndexError, StopIteration, TypeError):
        return None


class CompiledStep:
    """A jitted step called through executables compiled ahead, one per signature of its
    arguments: the tree structure and every leaf's shape, dtype (weak or not) and
    sharding. A smaller last batch is another program, as under ``jit``; so is a state that
    changed shape, dtype or placement. Nothing is retried: an error the step raises (while
    tracing, or from the running program) reaches the caller as it is.

    Args:
        jitted: the ``jax.jit``-wrapped step (its donation and shardings are kept).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> step = CompiledStep(jax.jit(lambda state, x: (x.sum(), state)))
        >>> _ = step(jnp.zeros(2), jnp.ones(3)); _ = step(jnp.zeros(2), jnp.ones(5))
        >>> _ = step(jnp.zeros(2), jnp.ones(3))
        >>> step.programs
        2
    """

    def __init__(self, jitted):
        self.jitted = jitted
        self._executables: dict[Any, Any] = {}
        self.memory: ProgramMemory | None = None  # the largest program's, so far

    @property
    def programs(self) -> int:
        """How many programs were compiled ahead (one per argument signature seen)."""
        return len(self._executables)

    @property
    def compiled(self) -> list:
        """The programs compiled so far (``jax.stages.Compiled``), in the order compiled:
        what ran, e.g. to read its HLO (``as_text()``) without compiling it again."""
        return list(self._executables.values())

    def prepare(self, *args):
        """The executable for ``args``, compiled now if it is not yet (nothing runs)."""
        key = signature(args)
        executable = self._executables.get(key)
        if executable is None:
            executable = self._executables[key] = self.jitted.lower(*args).compile()
            memory = ProgramMemory.of(executable)
            if self.memory is None or memory.peak > self.memory.peak:
                self.memory = memory
        return executable

    def __call__(self, *args):
        return self.prepare(*args)(*args)


def signature(args) -> tuple:
    """What selects a compiled program for ``args``: their tree structure and, per leaf, its
    abstract value (shape, dtype, weak type) and sharding — what an executable checks its
    arguments against. A leaf that is not a JAX array (a NumPy array, a Python number)
    counts by its shape and dtype, or its type.

    Example:
        >>> import jax.numpy as jnp
        >>> signature((jnp.ones(2),)) == signature((jnp.zeros(2),))
        True
        >>> signature((jnp.ones(2),)) == signature((jnp.ones(2, "bfloat16"),))
        False
    """
    import jax

    leaves, tree = jax.tree.flatten(args)
    return tree, tuple(_leaf_signature(x) for x in leaves)


def _leaf_signature(x) -> tuple:
    aval = getattr(x, "aval", None)
    if aval is not None:  # a jax.Array
        return aval, x.sharding
    shape = getattr(x, "shape", None)
    if shape is not None:
        return tuple(shape), str(x.dtype), None
    return type(x), None, None


def install(model) -> bool:
    """Makes ``model.train_function`` Keras' own jitted train step (the same donation and
    output shardings, ``kdist._keras_compat.keras_train_step``) called through a
    :class:`CompiledStep`. Nothing changes for a model that runs eagerly or without
    ``jit_compile``. Returns whether it was installed.

    Example:
        >>> install(model)  # after model.make_train_function()  # doctest: +SKIP
        True
    """
    from kdist import _keras_compat

    if model.run_eagerly or not model.jit_compile:
        return False
    step = CompiledStep(_keras_compat.keras_train_step(model))
    model.train_function = attach(_keras_compat.step_function(model, step), [step])
    return True


def attach(train_function, steps: list[CompiledStep]):
    """``train_function`` with the compiled steps it calls recorded on it (read by
    :func:`steps_of`).

    Example:
        >>> f = attach(lambda state, iterator: None, [])
        >>> steps_of(f)
        []
    """
    train_function.kdist_compiled_steps = list(steps)
    return train_function


def steps_of(train_function) -> list[CompiledStep] | None:
    """The compiled steps a train function calls (through wrappers that keep the wrapped
    function as ``unwrapped``, e.g. the input timer), or None if it was not built here.

    Example:
        >>> steps_of(lambda state, iterator: None) is None
        True
    """
    while train_function is not None:
        steps = getattr(train_function, "kdist_compiled_steps", None)
        if steps is not None:
            return steps
        train_function = getattr(train_function, "unwrapped", None)
    return None


def largest(steps: list[CompiledStep] | None) -> ProgramMemory | None:
    """The largest compiled program among ``steps`` (None before any compiled).

    Example:
        >>> largest([]) is None
        True
    """
    memories = [s.memory for s in steps or () if s.memory is not None]
    return max(memories, key=lambda m: m.peak) if memories else None

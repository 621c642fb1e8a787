"""The compiled train step's memory, as ``kdist.callbacks.Throughput`` logs it beside the
live buffers.

``compiled_peak_bytes`` is what the compiled train step needs per device — arguments +
temporaries + outputs not aliased + generated code, from the program's ``memory_analysis()``
(:mod:`kdist.compiled_step`: the step ``fit`` runs, compiled ahead of its first call, so
nothing compiles twice), its terms in ``compiled_memory``. ``memory_peak_bytes`` and
``memory_in_use_bytes`` are the live buffers (``device.memory_stats()``, which on a TPU
leaves XLA's temporaries out; on CPU the process RSS: :func:`kdist.callbacks.run_log.
memory_usage`).

Example:
    >>> compiled_memory([])
    {}
"""

from __future__ import annotations

from typing import Any

import keras

from kdist import compiled_step
from kdist.callbacks.run_log import memory_usage

MEMORY_NOTE = ("compiled_peak_bytes: the compiled train step's need per device, arguments + "
               "temporaries + outputs not aliased + generated code (memory_analysis(); "
               "kdist.compiled_step); memory_peak_bytes and memory_in_use_bytes: live "
               "buffers (device.memory_stats(), which leaves XLA's temporaries out on TPU; "
               "on CPU the process's resident memory, memory_source process_rss)")


def compiled_steps(model) -> tuple[list, str | None]:
    """The compiled train steps ``fit`` will call — kdist's tasks build their train function
    with them; for another model whose class keeps Keras' own ``make_train_function``, the
    same program is installed now (call it in ``on_train_begin``: ``fit`` has just made the
    train function) — or ``([], why not)``.

    Example:
        >>> compiled_steps(model)  # in on_train_begin  # doctest: +SKIP
        ([<kdist.compiled_step.CompiledStep ...>], None)
    """
    steps = compiled_step.steps_of(model.train_function)
    if steps is None and type(model).make_train_function is keras.Model.make_train_function:
        compiled_step.install(model)
        steps = compiled_step.steps_of(model.train_function)
    if steps is None:
        why = ("the model runs eagerly or without jit_compile" if model.run_eagerly
               or not model.jit_compile else
               f"{type(model).__name__} builds its own train function (make_train_function)")
        return [], f"{why}: no compiled program to read"
    return steps, None


def compiled_memory(steps: list) -> dict[str, Any]:
    """The row fields of the largest program compiled so far (none before the first
    step): Python attributes, read with no device or state sync."""
    memory = compiled_step.largest(steps)
    return {} if memory is None else memory.row()


class StepMemory:
    """The memory fields of a ``fit`` run's rows: the config row's note (and why there is no
    compiled figure, if so), each interval row's live and compiled figures.

    Example:
        >>> memory = StepMemory(model)  # in on_train_begin  # doctest: +SKIP
        >>> memory.row(devices)["compiled_peak_bytes"]  # after the first step  # doctest: +SKIP
        16834720
    """

    def __init__(self, model):
        self.steps, self.missing = compiled_steps(model)

    def config(self) -> dict[str, Any]:
        return {"memory_note": MEMORY_NOTE,
                **({"compiled_peak_unavailable": self.missing} if self.missing else {})}

    def row(self, devices: list) -> dict[str, Any]:
        return {**memory_usage(devices), **compiled_memory(self.steps)}

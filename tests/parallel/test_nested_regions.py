"""Nested regions carry only the collectives the theory says, axis by axis (HLO of the
compiled train step): a pipeline's stages talk by collective-permutes, a ring's by
collective-permutes over ``seq``, fsdp's gradients are reduce-scattered, nothing crosses
``replica`` outside DiLoCo's sync step, and kdist's 8-bit codes cost one byte per parameter
under ``stage`` and ``seq`` as they do alone. (That these meshes train like one device: the
rows of tests/parallel/combinations.py.)"""

import collections
import functools
import re

import jax
import numpy as np
import pytest

from kdist import _keras_compat, compiled_step, hlo
from kdist.groups import diloco
from tests.parallel.combinations import CONFIGS
from tests.parallel.harness import train_run

DEEP = dict(config=CONFIGS["deep"], rows=16)


def _by_axes(text, mesh_shape):
    """{(kind, axes): bytes per run of the program}."""
    found = collections.Counter()
    for c in hlo.parse_collectives(text, 8):
        found[c.kind, c.axes(mesh_shape)] += c.bytes * c.executions
    return found


def _kinds_over(found, axis):
    return {kind for kind, axes in found if axis in axes}


def _held_values(run, but=()):
    """Values of the trainable weights one device holds, counting axes in ``but`` as not
    sharded (a weight's fsdp shards are one parameter set)."""
    dist, total = run.distribution, 0
    for w in run.model.trainable_variables:
        axes = [a for a in dist.get_variable_layout(w).axes if a is not None and a not in but]
        total += w.value.size // int(np.prod([dist.mesh_shape[a] for a in axes]))
    return total


def test_stage_seq_fsdp_collectives_stay_on_their_axes():
    run = train_run("gpt", "stage=2,seq=2,fsdp=2", steps=1, context_parallel="ring", **DEEP)
    found = _by_axes(_compiled_step(run), run.distribution.mesh_shape)
    permutes = {axes for kind, axes in found if kind == "collective-permute"}
    assert permutes == {frozenset({"stage"}), frozenset({"seq"})}  # activations; K/V blocks
    scatters = {axes for kind, axes in found if kind == "reduce-scatter"}
    assert scatters == {frozenset({"fsdp"})}  # each stage's block gradients, over fsdp
    # The ring passes K/V blocks only: seq carries no gathered keys (the all-gather variant).
    assert not any(kind == "all-gather" and axes == {"seq"} for kind, axes in found)


def _compiled_step(run):
    """The HLO of the train step the run compiled and ran (read, not traced and compiled
    again: kdist.planning.compile.compile_train_step's is the same program)."""
    (step,) = compiled_step.steps_of(run.model.train_function)
    (program,) = step.compiled
    return program.as_text()


@pytest.fixture(scope="module")
def diloco_pipeline_ring():
    """replica=2,stage=2,seq=2: each DiLoCo group a 2-stage pipeline whose tokens are split
    over a 2-device ring; the inner step's and the sync step's programs."""
    run = train_run("gpt", "replica=2,stage=2,seq=2", steps=1, context_parallel="ring",
                    sync_every=2, **DEEP)
    state = _keras_compat.jax_state(run.model)
    x, y = run.batches[0][:2]
    lowered = {sync: jax.jit(functools.partial(diloco.train_step, run.model, sync=sync))
               .lower(state, (x, y)) for sync in (False, True)}
    # The step's transforms and DiLoCo's sync are named in the program (jax.named_scope;
    # in the lowered text: a compiled program from the cache keeps its first op names).
    names = {sync: _scopes(program) for sync, program in lowered.items()}
    assert {"kdist/split_sequence", "kdist/outer_sync"} <= names[True]
    assert "kdist/split_sequence" in names[False] and "kdist/outer_sync" not in names[False]
    texts = _trained_programs(run.model)
    return run, {sync: _by_axes(t, run.distribution.mesh_shape) for sync, t in texts.items()}


def _trained_programs(model) -> dict[bool, str]:
    """The HLO of the inner step's and the sync step's programs as training compiled and
    ran them (kdist.groups.diloco compiles both in the first step): read, not compiled
    again (~3.5 CPU-s each here)."""
    inner, sync = compiled_step.steps_of(model.train_function)
    assert len(inner.compiled) == len(sync.compiled) == 1
    return {False: inner.compiled[0].as_text(), True: sync.compiled[0].as_text()}


def test_the_schedule_and_the_reduction_are_named_in_the_program():
    """Profiles and the HLO show each transform's region: jax.named_scope("kdist/<name>")."""
    run = train_run("gpt", "stage=2,data=4", steps=1, pipeline_schedule="1f1b",
                    gradient_reduction="bfloat16", **DEEP)
    x, y = run.batches[0][:2]
    lowered = jax.jit(run.model.train_step).lower(_keras_compat.jax_state(run.model), (x, y))
    assert {"kdist/gradient_reduction", "kdist/pipeline_schedule"} <= _scopes(lowered)


def _scopes(lowered) -> set:
    return set(re.findall(r"kdist/\w+", lowered.as_text(debug_info=True)))


def test_nothing_crosses_replica_outside_the_sync_step(diloco_pipeline_ring):
    run, programs = diloco_pipeline_ring
    inner, sync = programs[False], programs[True]
    across = {s: sum(b for (_, axes), b in found.items() if "replica" in axes)
              for s, found in programs.items()}
    assert across[False] <= 8  # the mean of the logged loss
    # The sync: every held parameter's change once, in float32 (+ the loss's 4 bytes).
    held = _held_values(run) * 4
    assert held <= across[True] <= held + 8
    for found in (inner, sync):  # inside a group, as without DiLoCo
        assert {a for k, a in found if k == "collective-permute"} == {
            frozenset({"stage"}), frozenset({"seq"})}
        assert _kinds_over(found, "replica") <= {"all-reduce"}
    assert inner.keys() <= sync.keys()


@pytest.mark.parametrize("mesh, options", [
    ("stage=2,data=4", DEEP),
    ("seq=2,fsdp=4", dict(context_parallel="ring")),
], ids=["stage", "seq"])
def test_8bit_codes_cost_one_byte_per_parameter_under_stage_and_seq(mesh, options):
    run = train_run("gpt", mesh, steps=1, gradient_reduction="int8", **options)
    found = _by_axes(_compiled_step(run), run.distribution.mesh_shape)
    weights = run.model.trainable_variables
    exchanged = sum(b for (kind, _), b in found.items() if kind == "all-to-all")
    assert not any(kind == "reduce-scatter" for kind, _ in found)
    # As on fsdp=8 alone (tests/parallel/test_reduction.py): each held parameter once as a
    # one-byte code, plus a float32 scale per block: at most 3% more.
    params = _held_values(run, but=("fsdp",))
    assert params <= exchanged <= params * 1.03, (exchanged, params, len(weights))
    # No gradient travels in float32 over the batch axes: what is all-reduced there is
    # the loss and the optimizer's scalars (global norm), a few bytes per weight.
    batch_axes = {"data", "fsdp", "seq"}
    floats = sum(b for (kind, axes), b in found.items()
                 if kind == "all-reduce" and axes & batch_axes and not axes & {"stage"})
    assert floats <= 8 * len(weights)

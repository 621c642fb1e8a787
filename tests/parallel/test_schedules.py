"""Pipeline schedules as tick tables (kdist/parallel/schedules.py): every task once, in an
order the data flow allows; 1F1B's and interleaved's ticks of one kind, as many as GPipe's
(the bubble in time is the formula's); zero-bubble's W in idle cells; the activations of
1F1B and interleaved bounded by the stages, not the microbatches, and zero-bubble's by S.
Pure Python: no compilation."""

import pytest

from kdist.parallel.pipeline import schedules
from kdist.parallel.pipeline.settings import bubble_fraction

SHAPES = [(2, 2, 1), (2, 5, 1), (4, 8, 1), (4, 16, 1), (8, 32, 1), (2, 4, 2), (4, 8, 3),
          (4, 16, 2), (8, 16, 2), (4, 8, 4)]


def runs(name, stages, microbatches, chunks):
    """Whether the schedule takes these settings (the refusals are tested below)."""
    if name in ("1f1b", "zero_bubble"):
        return chunks == 1
    if name == "interleaved_1f1b":
        return chunks > 1 and microbatches % stages == 0
    return True


CASES = [(name, *shape) for name in schedules.SCHEDULES for shape in SHAPES
         if runs(name, *shape)]


def ticks_of(table):
    """(action, microbatch, virtual stage) -> tick, checking each runs exactly once."""
    when = {}
    for tick, row in enumerate(table.cells):
        assert len(row) == table.stages
        for stage, task in enumerate(row):
            if task is not None:
                key = (task.action, task.microbatch, task.chunk * table.stages + stage)
                assert key not in when, f"{key} runs twice"
                when[key] = tick
    return when


@pytest.mark.parametrize("name, stages, microbatches, chunks", CASES)
def test_every_task_runs_once_after_what_it_needs(name, stages, microbatches, chunks):
    table = schedules.build(name, stages, microbatches, chunks)
    when = ticks_of(table)
    last = stages * chunks - 1
    back = "I" if name == "zero_bubble" else "B"  # the task that sends the cotangent back
    computed = name != "gpipe"  # the interpreter's last virtual stage: F inside its B
    for m in range(microbatches):
        for k in range(last + 1):
            assert (back, m, k) in when
            assert (("F", m, k) in when) != (computed and k == last)
            if k > 0:  # the activation crosses one permute: a later tick
                assert when.get(("F", m, k), when[(back, m, k)]) > when[("F", m, k - 1)]
            assert when[(back, m, k)] > when.get(("F", m, k), -1)
            if k < last:  # the cotangent comes back from the next virtual stage
                assert when[(back, m, k)] > when[(back, m, k + 1)]
            if back == "I":  # the weight gradient after the input gradient
                assert when[("W", m, k)] > when[("I", m, k)]
    assert len(when) == (3 if back == "I" else 2) * microbatches * (last + 1) \
        - computed * microbatches


SHAPES_BY_STAGES = [(2, 2), (2, 4), (3, 6), (4, 8), (4, 16), (8, 16), (8, 32)]


@pytest.mark.parametrize("name, stages, microbatches, chunks", [
    (name, s, m, v) for name in schedules.LOCKSTEP for s, m in SHAPES_BY_STAGES
    for v in (1, 2, 3, 4) if runs(name, s, m, v)])
def test_lockstep_ticks_run_one_kind_and_as_many_as_gpipe(name, stages, microbatches,
                                                          chunks):
    """Every tick forwards only or backwards only (a lockstep tick lasts as long as its
    costliest task): v M + S - 2 forward ticks and v M + S - 1 backward ticks, GPipe's
    count less the last stage's forward — so the bubble in time is GPipe's formula
    (S - 1) / (v M + S - 1) whatever a backward costs against a forward."""
    kinds = schedules.build(name, stages, microbatches, chunks).kinds()
    assert set(kinds) == {"F", "B"}
    assert kinds.count("F") == chunks * microbatches + stages - 2
    assert kinds.count("B") == chunks * microbatches + stages - 1


@pytest.mark.parametrize("stages, microbatches, chunks", [(2, 2, 1), (4, 8, 1), (8, 32, 1),
                                                          (4, 8, 2), (8, 16, 2)])
def test_gpipe_bubble_equals_the_formula(stages, microbatches, chunks):
    """(S - 1) / (v M + S - 1): every stage idles 2 (S - 1) ticks of 2 (v M + S - 1)."""
    table = schedules.build("gpipe", stages, microbatches, chunks)
    assert table.ticks == 2 * (chunks * microbatches + stages - 1)
    assert table.bubble == pytest.approx(bubble_fraction(stages, microbatches, chunks),
                                         rel=1e-12)


@pytest.mark.parametrize("stages, microbatches", [(2, 2), (2, 5), (4, 8), (4, 16), (8, 16),
                                                  (8, 32)])
def test_zero_bubble_fills_idle_cells_with_weight_gradients(stages, microbatches):
    """ZB-H1: 3 M + S - 2 ticks — only the S - 2 before stage 0's first I idle on stage 0
    — where 1F1B's order with split tasks would take 3 (M + S - 1) - 1; no stage holds
    more than S microbatches (its W frees an input, not its I)."""
    S, M = stages, microbatches
    table = schedules.build("zero_bubble", S, M)
    assert table.ticks == 3 * M + S - 2
    idle_on_stage_0 = sum(row[0] is None for row in table.cells)
    assert idle_on_stage_0 == S - 2
    assert table.max_in_flight() == S
    assert table.max_deferred() >= 1  # some W did wait for an idle cell
    assert all(held[-1] == 0 for held in map(table.in_flight, range(S)))


def test_circular_gpipe_bubble_shrinks_with_the_repeats():
    table = schedules.build("gpipe", stages=4, microbatches=8, chunks=2)
    assert table.bubble == pytest.approx(bubble_fraction(4, 8, repeats=2), rel=1e-12)


@pytest.mark.parametrize("name, stages, chunks", [("1f1b", 2, 1), ("1f1b", 4, 1),
                                                  ("1f1b", 8, 1), ("interleaved_1f1b", 2, 2),
                                                  ("interleaved_1f1b", 4, 2),
                                                  ("interleaved_1f1b", 4, 3),
                                                  ("interleaved_1f1b", 8, 2)])
def test_1f1b_and_interleaved_hold_stages_not_microbatches(name, stages, chunks):
    """Stage s holds 2 (S - s) - 2 + (v - 1) S chunk inputs (its warm-up forwards and
    one; at most v M) at every M; GPipe holds all v M."""
    expected = [2 * (stages - s) - 2 + (chunks - 1) * stages for s in range(stages)]
    for microbatches in (stages, 2 * stages, 4 * stages):
        table = schedules.build(name, stages, microbatches, chunks)
        held = [max(table.in_flight(s)) for s in range(stages)]
        assert held == [min(e, chunks * microbatches) for e in expected]
        assert all(counts[-1] == 0 for counts in map(table.in_flight, range(stages)))
        assert schedules.build("gpipe", stages, microbatches, chunks).max_in_flight() == \
            chunks * microbatches


def test_timeline_draws_the_table():
    assert schedules.build("zero_bubble", 2, 3).timeline() == (
        "stage 0 | F0 F1 I0 W0 F2 I1 I2 W1 W2\n"
        "stage 1 | .  I0 I1 W0 W1 I2 W2 .  .")
    assert schedules.build("1f1b", 4, 6).timeline() == (
        "stage 0 | F0 F1 F2 .  F3 .  F4 .  F5 B0 .  B1 .  B2 B3 B4 B5\n"
        "stage 1 | .  F0 F1 .  F2 .  F3 B0 F4 B1 F5 B2 .  B3 B4 B5 .\n"
        "stage 2 | .  .  F0 .  F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5 .  .\n"
        "stage 3 | .  .  .  B0 .  B1 .  B2 .  B3 .  B4 .  B5 .  .  .")
    assert schedules.build("gpipe", 2, 2).timeline() == (
        "stage 0 | F0 F1 .  .  B0 B1\n"
        "stage 1 | .  F0 F1 B0 B1 .")
    assert schedules.build("gpipe", 2, 2, chunks=2).timeline() == (
        "stage 0 | F0a F1a F0b F1b .   .   B0b B1b B0a B1a\n"
        "stage 1 | .   F0a F1a F0b F1b B0b B1b B0a B1a .")


@pytest.mark.parametrize("args, message", [
    (("zb", 4, 8), "pipeline_schedule must be one of gpipe, 1f1b, interleaved_1f1b, "
                   "zero_bubble; got 'zb'"),
    (("1f1b", 4, 8, 2), "runs one model chunk per stage; got 2 \\(pipeline_repeats\\)"),
    (("zero_bubble", 4, 8, 2), "'zero_bubble' runs one model chunk per stage; got 2"),
    (("interleaved_1f1b", 4, 8), "several model chunks per stage; got pipeline_repeats=1"),
    (("interleaved_1f1b", 4, 6, 2), "pipeline_microbatches=6 is not a multiple of 4"),
    (("1f1b", 4, 2), "pipeline_microbatches=2 is fewer than the 4 stages"),
    (("gpipe", 0, 2), "stages must be a positive int; got 0"),
    (("gpipe", 2, True), "microbatches must be a positive int; got True"),
])
def test_bad_settings_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        schedules.build(*args)

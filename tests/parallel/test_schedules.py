"""Pipeline schedules as tick tables (kdist/parallel/schedules.py): every task once, in an
order the data flow allows; GPipe's and 1F1B's bubble against the formula; 1F1B's
activations bounded by the stages, not the microbatches. Pure Python: no compilation."""

import pytest

from kdist.parallel import schedules
from kdist.parallel.stages import bubble_fraction

SHAPES = [(2, 2, 1), (2, 5, 1), (4, 8, 1), (4, 16, 1), (8, 32, 1), (2, 4, 2), (4, 8, 3)]
CASES = [(name, *shape) for name in schedules.SCHEDULES for shape in SHAPES
         if name != "1f1b" or shape[2] == 1]  # 1F1B runs one chunk per stage (refused below)


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
    for m in range(microbatches):
        for k in range(last + 1):
            assert ("F", m, k) in when and ("B", m, k) in when
            if k > 0:  # the activation crosses one permute: a later tick
                assert when[("F", m, k)] > when[("F", m, k - 1)]
            assert when[("B", m, k)] > when[("F", m, k)]
            if k < last:  # the cotangent comes back from the next virtual stage
                assert when[("B", m, k)] > when[("B", m, k + 1)]
    assert len(when) == 2 * microbatches * (last + 1)


@pytest.mark.parametrize("name", schedules.SCHEDULES)
@pytest.mark.parametrize("stages, microbatches", [(2, 2), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_bubble_equals_the_formula(name, stages, microbatches):
    table = schedules.build(name, stages, microbatches)
    assert table.ticks == 2 * (microbatches + stages - 1)
    assert table.bubble == pytest.approx(bubble_fraction(stages, microbatches), rel=1e-12)


def test_circular_gpipe_bubble_shrinks_with_the_repeats():
    table = schedules.build("gpipe", stages=4, microbatches=8, chunks=2)
    assert table.bubble == pytest.approx(bubble_fraction(4, 8, repeats=2), rel=1e-12)


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_1f1b_holds_stages_not_microbatches(stages):
    for microbatches in (stages, 2 * stages, 4 * stages):
        one_f_one_b = schedules.build("1f1b", stages, microbatches)
        gpipe = schedules.build("gpipe", stages, microbatches)
        assert [max(one_f_one_b.in_flight(s)) for s in range(stages)] == \
            list(range(stages, 0, -1))
        assert gpipe.max_in_flight() == microbatches
        assert one_f_one_b.in_flight(0)[-1] == 0 == gpipe.in_flight(0)[-1]


def test_timeline_draws_the_table():
    assert schedules.build("gpipe", 2, 2).timeline() == (
        "stage 0 | F0 F1 .  .  B0 B1\n"
        "stage 1 | .  F0 F1 B0 B1 .")
    assert schedules.build("gpipe", 2, 2, chunks=2).timeline() == (
        "stage 0 | F0a F1a F0b F1b .   .   B0b B1b B0a B1a\n"
        "stage 1 | .   F0a F1a F0b F1b B0b B1b B0a B1a .")


@pytest.mark.parametrize("args, message", [
    (("zero_bubble", 4, 8), "pipeline_schedule must be one of gpipe, 1f1b; got 'zero_bubble'"),
    (("1f1b", 4, 8, 2), "runs one model chunk per stage; got 2 \\(pipeline_repeats\\)"),
    (("1f1b", 4, 2), "pipeline_microbatches=2 is fewer than the 4 stages"),
    (("gpipe", 0, 2), "stages must be a positive int; got 0"),
    (("gpipe", 2, True), "microbatches must be a positive int; got True"),
])
def test_bad_settings_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        schedules.build(*args)

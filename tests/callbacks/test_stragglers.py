"""Stragglers: a process whose input is slow is named, without a per-step sync.

The two-process run goes through ``kdist.launch`` with ``tests/multihost_script.py``
(command ``stragglers``): rank 1's loader is slowed on purpose.
"""


import numpy as np
import pytest

from kdist.callbacks.stragglers import InputTimer, Stragglers
from kdist.run_report import read_rows, summarize


def _row(process, wait, step=1.0):
    return {"process": process, "input_wait_s": wait, "step_time_median_s": step}


def test_a_process_slower_than_the_median_for_patience_intervals_is_named():
    judge = Stragglers(threshold=0.1, patience=2)
    slow = [_row(0, 0.01), _row(1, 0.30), _row(2, 0.02)]
    assert judge.judge(slow) == []  # once is not consistently
    with pytest.warns(UserWarning, match="process 1 is a straggler: it waits 0.300 s"):
        assert judge.judge(slow) == [1]
    assert judge.judge([_row(0, 0.01), _row(1, 0.05), _row(2, 0.02)]) == []  # recovered
    # Within the threshold (0.08 s more than the median of a 1 s step): never named.
    for _ in range(3):
        assert judge.judge([_row(0, 0.01), _row(1, 0.09), _row(2, 0.02)]) == []
    with pytest.raises(ValueError, match="threshold must be a number > 0"):
        Stragglers(threshold=0)
    with pytest.raises(ValueError, match="patience must be an integer >= 1"):
        Stragglers(patience=0)


def test_input_timer_times_only_the_wait_for_the_next_batch():
    timer = InputTimer()
    step = timer.wrap(lambda state, iterator: (state + sum(next(iterator)), iterator))
    state, iterator = step(0, iter([(1, 2), (3, 4)]))
    step(0, iter([(5, 6)]))
    assert state == 3 and timer.take(1)[1] == 1 and timer.take(5)[1] == 1
    assert timer.take() == (0, 0)
    assert step.unwrapped is not None


@pytest.mark.slow
@pytest.mark.xdist_group("multihost")  # one worker launches the processes once
def test_two_processes_name_the_one_whose_input_is_slow(multihost_cases):
    # tests/multihost_script.py's "stragglers" case: fsdp=8 over 2 processes, 12 steps,
    # rank 1's loader 0.3 s slower per batch.
    ranks = multihost_cases.ranks("stragglers")
    tmp_path = multihost_cases.out("stragglers")
    # Each process measured its own wait: rank 1's is its loader's extra 0.3 s per step.
    waits = [np.nanmedian(np.array(r["input_wait_s"][1:], float)) for r in ranks]
    assert waits[1] > 0.25 and waits[0] < 0.1
    rows = read_rows(tmp_path / "run")  # process 0's log: every process's figures
    intervals = [r for r in rows if r["kind"] == "interval"]
    gathered = [r for r in intervals if r.get("processes")]
    assert gathered and all(len(r["processes"]) == 2 for r in gathered)
    assert gathered[-1]["stragglers"] == [1]
    assert all(r["stragglers"] in ([], [1]) for r in gathered)  # never rank 0
    report = summarize(rows, tmp_path / "run")
    assert "  process 0: step" in report
    assert "  process 1: step" in report and "STRAGGLER (named at step" in report

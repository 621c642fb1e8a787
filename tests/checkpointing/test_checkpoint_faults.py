"""Fault injection: SIGKILL at random moments across the save phases, then a rerun, many times.

Every step announced ("Checkpoint: step N committed") must survive intact, every rerun must
resume from the newest announced step (or a newer committed one), and every logged loss must
equal an uninterrupted run's, bit for bit.
"""

import os
import random
import re
import signal
import time

import pytest

from kdist.checkpointing import committed_steps, verify_step
from tests.checkpointing.checkpoint_worker import start_worker
from tests.helpers import ProcessOutput

TRIALS = int(os.environ.get("KDIST_FAULT_TRIALS", "10"))
SEED = int(os.environ.get("KDIST_FAULT_SEED", "0"))
COMMITTED = re.compile(r"^Checkpoint: step (\d+) committed", re.M)


def losses(out):
    return dict(line.split()[1:] for line in out.splitlines() if line.startswith("loss "))


def kill_moment(directory, announced, out):
    """What the killed process was doing, read from the directory and its last output."""
    names = [p.name for p in directory.iterdir()] if directory.is_dir() else []
    if any(".orbax-checkpoint-tmp" in n for n in names):
        return "during a save (temporary directory present)"
    final = [int(n) for n in names if n.isdigit()]
    if final and max(final) > max(announced, default=0):
        return "after the rename, before the commit message"
    if out.rstrip().splitlines()[-1:] and COMMITTED.match(out.rstrip().splitlines()[-1]):
        return "right after the commit message"
    return "between saves (training step)"


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_no_announced_step(tmp_path):
    rng = random.Random(SEED)
    # The uninterrupted run's losses, trained without saving (40 saves cost ~7 CPU-s): the
    # saves of the runs compared with it must not change a loss either.
    reference = start_worker(tmp_path / "reference", "reference")
    out = reference.communicate(timeout=300)[0]
    assert reference.returncode == 0 and "DONE" in out, out
    expected = losses(out)
    assert len(expected) == 40

    directory, announced_ever, moments, resumed_from = tmp_path / "ckpt", set(), [], []
    worker = ProcessOutput(start_worker(directory, "faults"))
    for _ in range(TRIALS):
        worker.wait_for(lambda lines: any(x.startswith("resumed ") for x in lines), timeout=120)
        start = int(next(x for x in worker.lines if x.startswith("resumed ")).split()[1])
        resumed_from.append(start)
        assert start >= max(announced_ever, default=0), "".join(worker.lines)
        target = start + rng.randint(2, 4)
        if rng.random() < 0.35:  # right after a commit message
            worker.wait_for(lambda lines, t=target: any(
                (m := COMMITTED.match(x)) and int(m[1]) >= t for x in lines), timeout=120)
        else:  # before or during a save: a random delay after a step ended
            worker.wait_for(lambda lines, t=target: f"batch {t}\n" in lines, timeout=120)
            time.sleep(rng.uniform(0, 0.12))
        worker.proc.send_signal(signal.SIGKILL)
        status, out = worker.finish(timeout=60)
        assert status == -signal.SIGKILL, out
        announced = {int(n) for n in COMMITTED.findall(out)}
        moments.append(kill_moment(directory, announced, out))
        announced_ever |= announced
        committed = committed_steps(directory)
        assert announced_ever <= set(committed), (sorted(announced_ever), committed, out)
        for step in announced:
            assert verify_step(directory / str(step)) == [], step
        got = losses(out)
        assert {k: expected[k] for k in got} == got  # bit-exact, every step
        worker = ProcessOutput(start_worker(directory, "faults"))

    status, out = worker.finish(timeout=300)
    assert status == 0 and "DONE" in out and "step=40" in out, out
    got = losses(out)
    assert got and {k: expected[k] for k in got} == got
    assert 40 in committed_steps(directory)
    summary = {m: moments.count(m) for m in sorted(set(moments))}
    print(f"\n{TRIALS} SIGKILLs (seed {SEED}); kill moments: {summary}; resumed from "
          f"{resumed_from}")

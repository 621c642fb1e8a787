"""Checkpoints across processes: written by 2 processes × 4 devices, restored by 1 × 8 (and
back), a killed rank's job relaunched from the last committed step, and a SIGTERM that
reaches one rank saving the same step in both.

The multi-process runs go through ``kdist.launch`` with ``tests/multihost_script.py ckpt``;
the one-process runs call the same function in this (8-device) process. Every run is the
same tiny GPT under ``fsdp=8`` with one-step epochs, so "step k" is epoch k.
"""

import argparse
import json
import os
import signal
import sys
import time

import numpy as np
import pytest

from kdist import launch
from kdist.checkpointing import committed_steps
from tests import multihost_script
from tests.test_multihost import SCRIPT, Launched

MESH = "fsdp=8"
STEPS = 6  # the uninterrupted reference's length; every test stays within it



def one_process(out, ckpt, steps, tag, save_every=2):
    """``multihost_script ckpt`` in this process (1 process × 8 devices)."""
    args = argparse.Namespace(mesh=MESH, steps=steps, out=str(out), ckpt=str(ckpt),
                              save_every=save_every, hang_at=None, tag=tag)
    return multihost_script.ckpt(args)


def ckpt_args(out, ckpt, steps, tag, *extra):
    return [SCRIPT, "ckpt", "--mesh", MESH, "--steps", str(steps), "--out", str(out),
            "--ckpt", str(ckpt), "--tag", tag, *extra]


def state(out, name):
    with np.load(out / f"{name}.npz") as f:
        return dict(f)


def assert_same_state(a, b):
    assert sorted(a) == sorted(b)
    assert any(k.startswith("optimizer.") for k in a)  # the whole training state, not weights
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)  # bit-exact


def printed_losses(lines):
    """``{step: loss}`` from the ``[r] step k loss x`` lines of a launched run (rank 0)."""
    return {int(x.split()[2]): float(x.split()[4]) for x in lines
            if x.startswith("[0] step ")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted one-process run of STEPS steps: its per-step losses."""
    out = tmp_path_factory.mktemp("reference")
    run = one_process(out, out / "ckpt", STEPS, "reference")
    assert run["restored_step"] == 0 and sorted(run["losses"]) == list(map(str, range(1, 7)))
    return {int(k): v for k, v in run["losses"].items()}


@pytest.mark.slow
@pytest.mark.xdist_group("multihost_checkpoint_reference")  # the module fixture (a process) once
def test_checkpoints_move_between_one_and_two_processes(tmp_path, child_env, reference):
    """1 process writes step 2; 2 processes restore it, train to 4 and write step 4; 1
    process restores that and trains to 6. Restored states equal the saved ones bit for bit
    and the losses follow the uninterrupted run."""
    ckpt = tmp_path / "ckpt"
    first = one_process(tmp_path, ckpt, 2, "one")
    assert committed_steps(ckpt) == [2]

    status = launch.launch([sys.executable, *ckpt_args(tmp_path, ckpt, 4, "two")],
                           processes=2, devices_per_process=4)
    assert status == 0
    assert committed_steps(ckpt) == [2, 4]
    two = [json.loads((tmp_path / f"ckpt-rank{r}.json").read_text())
           for r in (0, 1)]
    assert [(r["process_count"], r["restored_step"], r["step"]) for r in two] == [(2, 2, 4)] * 2
    assert_same_state(state(tmp_path, "one-final"), state(tmp_path, "two-restored"))

    last = one_process(tmp_path, ckpt, STEPS, "last")
    assert (last["process_count"], last["devices"], last["restored_step"]) == (1, 8, 4)
    assert_same_state(state(tmp_path, "two-final"), state(tmp_path, "last-restored"))

    losses = {**first["losses"], **two[0]["losses"], **last["losses"]}
    assert two[0]["losses"] == two[1]["losses"]
    assert sorted(map(int, losses)) == list(range(1, STEPS + 1))  # each step ran once
    for step, loss in losses.items():
        # One process: bit-exact. Two: the same sums over other collectives (~1 ulp).
        np.testing.assert_allclose(loss, reference[int(step)], rtol=2e-6, err_msg=step)
    assert [first["losses"][k] for k in ("1", "2")] == [reference[1], reference[2]]
    assert reference[STEPS] < reference[1]  # it trained


@pytest.mark.slow
@pytest.mark.xdist_group("multihost_checkpoint_reference")
def test_a_killed_rank_ends_the_job_and_the_relaunch_resumes(tmp_path, child_env, reference):
    """Rank 0 stalls inside step 4's commit (arrays written, no commit marker); rank 1 is
    killed there. The launcher stops rank 0 and exits 137 within its grace period. The same
    command again cleans the partial step 4, resumes from step 2 and repeats steps 3..6
    with the losses the killed run printed (bit-exact) and the reference's."""
    ckpt = tmp_path / "ckpt"
    command = ["--processes", "2", "--devices-per-process", "4", "--grace", "5",
               *ckpt_args(tmp_path, ckpt, STEPS, "killed", "--hang-at", "4")]
    run = Launched(*command)
    run.wait_for(lambda lines: any("hanging in the commit of step 4" in x for x in lines))
    assert committed_steps(ckpt) == [2]
    assert [p.name for p in ckpt.iterdir() if p.name.startswith("4.orbax-checkpoint-tmp")]
    killed_at = time.monotonic()
    os.kill(run.pids()[1], signal.SIGKILL)
    status, output = run.finish(timeout=60)
    assert status == 128 + signal.SIGKILL, output
    # "; stopping the others" follows unless rank 0 died of the lost peer in the same poll
    # (Gloo's "Connection reset by peer" can end it within the launcher's 50 ms poll); that
    # the launcher stops the others: tests/test_multihost.py, with children that outlive it
    assert "[launch] rank 1 exited with status 137" in output
    assert time.monotonic() - killed_at < 5 + 5  # the grace period, plus polling and exit
    before = printed_losses(run.lines)
    assert {1, 2, 3} <= set(before)  # it trained past the last committed step

    again = Launched(*command)  # the same command
    status, output = again.finish(timeout=600)
    assert status == 0, output
    assert "resumed from" in output and f"{ckpt / '2'} (step 2" in output
    assert "left by an interrupted save" in output  # the partial step 4 was removed ...
    assert committed_steps(ckpt) == [2, 4, 6]
    assert not [p for p in ckpt.iterdir() if "tmp" in p.name]  # ... and nothing else is left
    after = printed_losses(again.lines)
    assert sorted(after) == list(range(3, STEPS + 1))  # steps 1, 2 were not repeated
    for step in set(before) & set(after):
        assert after[step] == before[step], step  # bit-exact: the same two processes
    for step, loss in after.items():
        np.testing.assert_allclose(loss, reference[step], rtol=2e-6, err_msg=str(step))


@pytest.mark.slow
def test_sigterm_to_one_rank_saves_the_same_step_in_both(tmp_path, child_env):
    """A preemption notice that reaches one process only: the per-step all-gather makes
    both save the same step, commit it and exit 143 (no save is scheduled otherwise)."""
    ckpt = tmp_path / "ckpt"
    run = Launched("--processes", "2", "--devices-per-process", "4", "--grace", "20",
                   *ckpt_args(tmp_path, ckpt, 400, "term", "--save-every", "1000"))
    run.wait_for(lambda lines: any(x.startswith("[1] step 2 loss") for x in lines))
    os.kill(run.pids()[1], signal.SIGTERM)
    status, output = run.finish(timeout=120)
    assert status == 128 + signal.SIGTERM, output
    said = {x[:3]: x.split("step ")[1].split()[0] for x in run.lines
            if "SIGTERM received; step" in x}
    assert set(said) == {"[0]", "[1]"} and len(set(said.values())) == 1, output
    assert committed_steps(ckpt) == [int(said["[0]"])]
    assert int(said["[0]"]) < 400

"""Replica groups as separate jobs (``python -m kdist.launch --replica-groups G``): the
same function as DiLoCo in one program, and a job that goes on when a group dies, stalls,
is replaced by a spare, or does not belong.

Every run is ``tests/multihost_script.py groups``: the tiny GPT of the multi-process tests,
one-step epochs, each group 1 process x 4 host devices with ``data=4`` inside (the
asynchronous job: 2 processes x 2 devices per group).
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from kdist.checkpointing.state import restore_tree
from kdist.groups.history import job_lines
from kdist.groups.store import Store
from kdist.parallel.group_jobs import REFUSED
from kdist.run_report import read_rows, summarize
from tests import multihost_script
from tests.helpers import ROOT, ProcessOutput, child_environment
from tests.test_multihost import SCRIPT

MESH = "replica=2,data=4"


class Job(ProcessOutput):
    """``python -m kdist.launch --replica-groups ...`` in the background; each output line
    kept with the time it arrived."""

    def __init__(self, *args):
        self.times = []
        super().__init__(subprocess.Popen(
            [sys.executable, "-m", "kdist.launch", *args], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=child_environment()))

    def _read(self):
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self.times.append(time.monotonic())
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def pid(self, group: int) -> int:
        """The newest process of ``group``."""
        return [int(x.split()[-1]) for x in self.lines
                if x.startswith(f"[groups] group {group} rank 0 pid")][-1]

    def steps(self, group: int) -> list[tuple[int, float, float]]:
        """``(step, loss, arrival time)`` of every step ``group`` printed."""
        return [(int(x.split()[2]), float(x.split()[4]), t)
                for x, t in zip(self.lines, self.times) if x.startswith(f"[g{group}] step ")]

    def count(self, text: str) -> int:
        return sum(text in x for x in self.lines)


def job_args(tmp_path, steps, *extra, groups=2, processes=1, **script):
    """A job of ``groups`` groups, each ``processes`` processes holding 4 devices in all."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in script.items()]
    return ["--replica-groups", str(groups), "--processes-per-group", str(processes),
            "--devices-per-process", str(4 // processes),
            "--replica-store", str(tmp_path / "store"), *extra, SCRIPT, "groups",
            "--mesh", MESH, "--steps", str(steps), "--out", str(tmp_path), "--tag", "job",
            *flags]


def in_one_program(tmp_path, steps, sync_every, tag="one", learning_rate=1e-2):
    """The same DiLoCo in this (8-device) process: ``replica=2,data=4`` in one program."""
    import argparse

    args = argparse.Namespace(mesh=MESH, sync_every=sync_every, steps=steps, out=str(tmp_path),
                              ckpt=None, save_every=2, tag=tag, step_sleep=0.0,
                              learning_rate=learning_rate, late_group=None, late_seconds=0.0)
    return multihost_script.groups(args)


def weights(tmp_path, name):
    with np.load(tmp_path / f"{name}.npz") as f:
        return dict(f)


def assert_outer_states_intact(store_dir):
    """Every committed outer state has its checksums, and nothing of an uncommitted save
    sits under a committed name (no torn commit)."""
    store = Store(store_dir, 0)
    rounds = store.outer_rounds()
    assert rounds
    for r in rounds:
        assert store.outer_meta(r)["checksums"], r
        for p in store.outer_dir(r).rglob("*"):
            assert ".orbax-checkpoint-tmp" not in str(p), p


def test_two_group_jobs_train_like_one_program(tmp_path, child_env):
    """G = 2 jobs of 4 devices equal DiLoCo on ``replica=2,data=4`` in one program over 3
    rounds and the partial round of fit's last step (7 steps, H = 2): each step's loss (one
    program logs the groups' mean) to rtol 2e-6, the final weights to the suite's float32
    weight tolerance (atol 2e-6), both groups' weights identical, and the same validation
    loss."""
    job = Job(*job_args(tmp_path, 7, sync_every=2))
    status, output = job.finish(timeout=400)
    assert status == 0, output
    reference = in_one_program(tmp_path, 7, 2)
    groups = [json.loads((tmp_path / f"groups-g{g}-rank0.json").read_text()) for g in (0, 1)]
    for step in map(str, range(1, 8)):
        mean = (groups[0]["losses"][step] + groups[1]["losses"][step]) / 2
        np.testing.assert_allclose(mean, reference["losses"][step], rtol=2e-6, err_msg=step)
    assert groups[0]["losses"] != groups[1]["losses"]  # each group trained its own share
    one, sep0, sep1 = (weights(tmp_path, n) for n in ("one-g0", "job-g0", "job-g1"))
    assert sorted(one) == sorted(sep0)
    for key in one:
        np.testing.assert_array_equal(sep0[key], sep1[key], err_msg=key)
        np.testing.assert_allclose(sep0[key], one[key], atol=2e-6, rtol=0, err_msg=key)
    for g in groups:
        np.testing.assert_allclose(g["validation"], reference["validation"], rtol=2e-6)
        assert [r["members"] for r in g["rounds"] if "round" in r] == [[0, 1]] * 4
    assert output.count("outer state of round") == 5  # rounds 0 (the start), 1, 2, 3, 4
    for g in (0, 1):  # the throughput log's rows show each round; kdist report says so
        rows = read_rows(tmp_path / f"job-run-g{g}")
        shown = [e for r in rows if r.get("kind") == "interval" for e in r.get("rounds", [])]
        assert [e["round"] for e in shown if "round" in e] == [1, 2, 3, 4]
        assert "replica rounds: 4 (this group in 4, behind 0 times)" in summarize(rows)
    assert "2 groups in 4 rounds" in "\n".join(job_lines(tmp_path / "store"))
    assert "job done: 2 of 2 groups finished every step (round 4)" in output
    assert_outer_states_intact(tmp_path / "store")


@pytest.mark.slow
def test_a_group_job_shorter_than_a_round_saves_what_it_trained(tmp_path, child_env):
    """3 steps of --sync-every 50: fit's last step ends the one, partial, round through the
    store, so both groups end with the same trained weights, in their checkpoints too (each
    group kept its initial weights: no round ever ended)."""
    job = Job(*job_args(tmp_path, 3, sync_every=50, ckpt=tmp_path / "ckpt", save_every=50))
    status, output = job.finish(timeout=400)
    assert status == 0, output
    final = [weights(tmp_path, f"job-g{g}") for g in (0, 1)]
    for g in (0, 1):
        result = json.loads((tmp_path / f"groups-g{g}-rank0.json").read_text())
        assert [r["members"] for r in result["rounds"] if "round" in r] == [[0, 1]]
        assert result["validation"] < result["validation_before"] - 0.1
        # The checkpoint of step 3, saved at fit's end, holds the synchronised weights.
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        saved = restore_tree(tmp_path / "ckpt" / f"group-{g}" / "3", {
            "params." + k.replace("/", "."): jax.ShapeDtypeStruct(v.shape, v.dtype,
                                                                  sharding=device)
            for k, v in final[g].items()})
        for key, value in final[0].items():
            np.testing.assert_array_equal(final[g][key], value, err_msg=key)
            np.testing.assert_array_equal(saved["params." + key.replace("/", ".")], value)
    assert Store(tmp_path / "store", 0).outer_meta(1)["steps"] == [3, 3]


@pytest.mark.slow
def test_a_killed_group_is_replaced_then_restarted_and_a_stalled_one_left_out(tmp_path,
                                                                              child_env):
    """Group 1 is SIGKILLed twice at random moments (a spare takes its place, then it
    restarts) and stopped for 3x a round's time once; group 0 never stops and runs every
    step, group 1 every step it did not skip on rejoining, the job exits 0, and both final
    validation losses are within 2% of the same training without faults."""
    steps, sync_every, sleep = 45, 3, 0.25
    job = Job(*job_args(tmp_path, steps, "--spare-groups", "1", "--round-deadline", "4",
                        "--max-restarts", "2", sync_every=sync_every, step_sleep=sleep,
                        ckpt=tmp_path / "ckpt", save_every=sync_every, learning_rate=1e-3))
    rng = random.Random(0)
    kills = []
    for n in range(2):
        done = len(job.steps(1))
        job.wait_for(lambda lines, done=done: len(job.steps(1)) >= done + 4, timeout=300)
        time.sleep(rng.uniform(0, sync_every * sleep))  # anywhere in a round
        os.kill(job.pid(1), signal.SIGKILL)
        kills.append(time.monotonic())
        job.wait_for(lambda lines, n=n: sum("failed at round" in x for x in lines) > n)
    job.wait_for(lambda lines: sum("[g1] [groups] group 1 joined" in x for x in lines) >= 2,
                 timeout=300)
    job.wait_for(lambda lines: len(job.steps(1)) >= 3 + sum(1 for _ in job.steps(1)[:0]))
    started = job.steps(1)[-1][0]
    # Stopped just after the first step of a round, two steps (0.5 s) before it publishes:
    # the round closes without it (deadline 4 s) and it finds itself behind. Stopped at any
    # step, it had sometimes published already (the round then closed with it; seen on a
    # loaded machine).
    job.wait_for(lambda lines: (last := job.steps(1)[-1][0]) > started + 1
                 and last % sync_every == 1)
    pid = job.pid(1)
    os.kill(pid, signal.SIGSTOP)  # a stalled group: 3x a round's time
    time.sleep(3 * sync_every * sleep + 4)
    os.kill(pid, signal.SIGCONT)
    status, output = job.finish(timeout=600)
    assert status == 0, output

    survivor = job.steps(0)
    assert [s for s, _, _ in survivor] == list(range(1, steps + 1)), output  # never restarted
    gaps = np.diff([t for _, _, t in survivor])
    assert gaps.max() < 4 + 6 + 3, gaps  # at most one round's deadline (+ heartbeat, slack)
    # Group 1 ran every step it did not skip on rejoining (kdist.groups.skip_to_job: from
    # the job's step, not its own checkpoint's), and ended with the job: at its last step,
    # or — having rejoined behind the job's step — at the job's last round, saying which
    # steps it leaves untrained.
    skipped = {s for x in job.lines if "[g1] [groups] group 1 restored step" in x
               for a, b in [re.search(r"steps (\d+)-(\d+) skipped", x).groups()]
               for s in range(int(a), int(b) + 1)}
    ended = [int(m.group(1)) if m else steps for x in job.lines
             if "[g1] [groups] group 1: the job ended" in x
             for m in [re.search(r"its steps after step (\d+) not trained", x)]]
    untrained = set(range(ended[-1] + 1, steps + 1)) if ended else set()
    ran = {s for s, _, _ in job.steps(1)}
    assert sorted(ran | skipped | untrained) == list(range(1, steps + 1)), \
        (sorted(ran), sorted(skipped), ended)
    assert max(ran) == steps or ended
    # Both groups end with the job's outer state of its last round, bit for bit.
    final = [weights(tmp_path, f"job-g{g}") for g in (0, 1)]
    for key in final[0]:
        np.testing.assert_array_equal(final[0][key], final[1][key], err_msg="\n".join(
            [key] + [x.rstrip() for x in job.lines if "[groups]" in x]))
    assert job.count("[groups] group 1 failed at round") == 2
    assert job.count("spare 0 starts in its place") == 1
    assert job.count("restarting it (restart 1 of 2)") == 1
    # The stall: group 1 finds rounds closed without it and catches up — or, when the job
    # ended meanwhile, ends with its last round.
    assert job.count("[g1] [groups] group 1 was behind") + \
        job.count("[g1] [groups] group 1: the job ended") >= 1, output
    assert "job done: 2 of 2 groups finished every step" in output
    events = [json.loads(x) for x in (tmp_path / "store" / "events.jsonl").read_text().split("\n")
              if x]
    assert [e["action"] for e in events if e["event"] == "failure"] == ["spare", "restart"]
    rejoined = [t for x, t in zip(job.lines, job.times) if "[g1] [groups] group 1 joined" in x]
    assert all(r - k < 120 for r, k in zip(rejoined, kills))  # start-up and one round
    assert_outer_states_intact(tmp_path / "store")

    reference = in_one_program(tmp_path, steps, sync_every, tag="reference", learning_rate=1e-3)
    finals = [json.loads((tmp_path / f"groups-g{g}-rank0.json").read_text())["validation"]
              for g in (0, 1)]
    # Both groups within 2% of the run without faults: group 1 rejoins at the job's step,
    # so it ends with the job's last rounds rather than training rounds of its own after
    # group 0 has finished.
    for final in finals:
        assert abs(final - reference["validation"]) < 0.02 * reference["validation"], \
            (finals, reference["validation"])


@pytest.mark.slow
def test_every_group_dead_ends_the_job_with_the_outer_state_durable(tmp_path, child_env):
    job = Job(*job_args(tmp_path, 400, "--max-restarts", "0", sync_every=2, step_sleep=0.2))
    job.wait_for(lambda lines: len(job.steps(0)) >= 5 and len(job.steps(1)) >= 5)
    for group in (0, 1):
        os.kill(job.pid(group), signal.SIGKILL)
    status, output = job.finish(timeout=120)
    assert status == 1, output
    assert "only 0 group(s) left, fewer than --min-groups 1: the job ends" in output
    durable = Store(tmp_path / "store", 0).outer_rounds()
    assert durable and durable[-1] >= 2
    assert f"The outer state of round {durable[-1]} is durable" in output
    assert_outer_states_intact(tmp_path / "store")


@pytest.mark.slow
def test_a_group_with_another_config_is_refused_at_its_first_round(tmp_path, child_env):
    """Two groups started by hand, as a cluster scheduler would (no supervisor): group 1
    with another sync_every is refused, naming it; group 0 trains on alone."""
    store = tmp_path / "store"

    def group(index, sync_every):
        env = child_environment(KDIST_REPLICA_GROUP=str(index), KDIST_REPLICA_GROUPS="2",
                                KDIST_REPLICA_STORE=str(store), KDIST_REPLICA_DEADLINE="5",
                                XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace(
                                    "device_count=8", "device_count=4"))
        return ProcessOutput(subprocess.Popen(
            [sys.executable, SCRIPT, "groups", "--mesh", MESH, "--steps", "6",
             "--sync-every", str(sync_every), "--out", str(tmp_path), "--tag", "byhand"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env))

    first = group(0, 2)
    first.wait_for(lambda lines: any("outer state of round 0" in x for x in lines))
    second = group(1, 3)
    status, output = second.finish(timeout=300)
    assert status == REFUSED, output
    assert "refused: group 1 differs from the job" in output
    assert "sync_every: the job's 2, this group's 3" in output
    status, output = first.finish(timeout=300)
    assert status == 0, output
    assert "step 6 loss" in output


@pytest.mark.slow
def test_asynchronous_groups_never_wait_and_still_learn(tmp_path, child_env):
    """Each group 2 processes x 2 devices (its own JAX cluster of 4 devices): the group's
    decisions (which round, who took part, how stale) are process 0's, and both processes
    act on the same ones."""
    # Group 1 starts 20 s late: group 0 trains all its rounds first (as a loaded machine
    # once made it, the other way round) and must still end with group 1's last round.
    job = Job(*job_args(tmp_path, 11, "--replica-mode", "async", processes=2, sync_every=2,
                        late_group=1, late_seconds=20))
    status, output = job.finish(timeout=400)
    assert status == 0, output
    assert all(f"[g{g}.{r}] step 11 loss" in output for g in (0, 1) for r in (0, 1))
    groups = [json.loads((tmp_path / f"groups-g{g}-rank0.json").read_text()) for g in (0, 1)]
    for g, rank0 in enumerate(groups):
        rank1 = json.loads((tmp_path / f"groups-g{g}-rank1.json").read_text())
        assert rank1["losses"] == rank0["losses"] and rank1["validation"] == rank0["validation"]
        decisions = [[(r.get("round"), r.get("join"), r.get("members"), r.get("behind"))
                      for r in rank["rounds"]] for rank in (rank0, rank1)]
        assert decisions[0] == decisions[1], g
    for g in groups:
        rounds = [r for r in g["rounds"] if "round" in r]  # not the join
        # 5 rounds of H = 2, and fit's last step ends a partial round of 1
        assert all(r["waited"] == 0.0 for r in rounds) and len(rounds) == 6
        assert g["losses"]["11"] < g["losses"]["1"] - 0.2  # measured 5.80 -> 3.55, 5.81 -> 2.68
    for g in groups:
        closed = [r["round"] for r in g["rounds"] if "round" in r]
        assert closed == sorted(set(closed))
    assert Store(tmp_path / "store", 0).closed_rounds()[-1] >= 6  # none waited for another
    # ... until the end: the group done first waits for the other's last round and ends
    # with it (kdist.groups.job_end), so both hold the job's last outer weights.
    assert "[g0.0] [groups] group 0: ends with round" in output, output
    assert groups[0]["validation"] == groups[1]["validation"], output

"""The group job's environment, the store's commits and the supervisor's checks: no JAX
program, no child process but the launcher's refusal."""

import json
import subprocess
import sys
import time

import pytest

from kdist.groups.store import STALE_AFTER, Store, StoreError, describe
from kdist.groups.supervisor import supervise
from kdist.parallel import group_jobs as groups_job
from tests.helpers import ROOT

ENV = {"KDIST_REPLICA_GROUP": "1", "KDIST_REPLICA_GROUPS": "2", "KDIST_REPLICA_STORE": "/s"}


def test_the_environment_names_the_group_and_every_bad_value_its_variable():
    job = groups_job.from_environment(dict(ENV, KDIST_REPLICA_MIN="2",
                                           KDIST_REPLICA_DEADLINE="7.5",
                                           KDIST_REPLICA_MODE="async"))
    assert (job.index, job.count, job.store, job.min_groups, job.deadline, job.mode) == \
        (1, 2, "/s", 2, 7.5, "async")
    assert groups_job.from_environment({}) is None
    for change, named in [({"KDIST_REPLICA_GROUP": "2"}, "KDIST_REPLICA_GROUP='2'"),
                          ({"KDIST_REPLICA_GROUP": "x"}, "KDIST_REPLICA_GROUP='x'"),
                          ({"KDIST_REPLICA_GROUPS": "0"}, "KDIST_REPLICA_GROUPS='0'"),
                          ({"KDIST_REPLICA_MIN": "3"}, "KDIST_REPLICA_MIN='3'"),
                          ({"KDIST_REPLICA_DEADLINE": "-1"}, "KDIST_REPLICA_DEADLINE"),
                          ({"KDIST_REPLICA_DEADLINE": "nan"}, "KDIST_REPLICA_DEADLINE"),
                          ({"KDIST_REPLICA_MODE": "eager"}, "KDIST_REPLICA_MODE='eager'"),
                          ({"KDIST_REPLICA_STORE": ""}, "KDIST_REPLICA_STORE")]:
        with pytest.raises(ValueError, match=named):
            groups_job.from_environment(dict(ENV, **change))
    with pytest.raises(ValueError, match="without KDIST_REPLICA_GROUP"):
        groups_job.from_environment({"KDIST_REPLICA_STORE": "/s"})


def test_the_group_mesh_is_the_job_mesh_with_one_replica():
    job = groups_job.from_environment(ENV)
    assert groups_job.local_spec("replica=2,data=4", job) == "replica=1,data=4"
    assert groups_job.local_spec("data=2, replica = 2,fsdp=2", job) == "data=2, replica = 1,fsdp=2"
    with pytest.raises(ValueError, match="replica=3 but the job was started with 2"):
        groups_job.local_spec("replica=3,data=4", job)
    with pytest.raises(ValueError, match="names no 'replica=N'"):
        groups_job.local_spec("data=8", job)


def test_a_round_closes_once_and_every_group_reads_the_same_members(tmp_path):
    a, b = Store(tmp_path, 0), Store(tmp_path, 1)
    a.check_writable()
    assert a.quorum(3) is None and a.closed_rounds() == []
    first = a.propose(3, [1, 0], waited=0.5)
    second = b.propose(3, [0], waited=9.0)  # late: the first proposal stands
    assert first == second == b.quorum(3)
    assert first["members"] == [0, 1] and first["proposer"] == 0
    assert a.closed_rounds() == [3]
    assert not [p for p in (tmp_path / "rounds" / "000003").iterdir() if p.name.startswith(".")]


def test_the_manifest_is_the_first_group_s(tmp_path):
    first, wrote = Store(tmp_path, 1).manifest({"model": "a"})
    second, wrote_again = Store(tmp_path, 0).manifest({"model": "b"})
    assert wrote and not wrote_again
    assert first == second == {"fingerprint": {"model": "a"}, "group": 1}


def test_running_groups_are_those_with_a_fresh_training_heartbeat(tmp_path):
    store = Store(tmp_path, 0)
    store.check_writable()
    Store(tmp_path, 0).beat(state="training")
    Store(tmp_path, 1).beat(state="starting")
    Store(tmp_path, 2).beat(state="waiting")
    Store(tmp_path, 3).beat(state="dead")
    assert store.running() == {0, 2}
    assert store.running(now=time.time() + STALE_AFTER + 1) == set()  # stale: not running
    assert set(describe(tmp_path)["heartbeats"]) == {0, 1, 2, 3}


def test_an_outer_state_counts_only_with_its_marker_and_damage_is_named(tmp_path):
    import jax.numpy as jnp
    import numpy as np

    store = Store(tmp_path, 0)
    store.check_writable()
    tree = {"theta": {"w0000": jnp.arange(4.0)}, "momenta": {"w0000": jnp.zeros(4)}}
    store.save_outer(1, tree, {"members": [0]})
    (tmp_path / "outer" / "000002").mkdir()  # a save killed before its marker
    assert store.outer_rounds() == [1]
    target = {"theta": {"w0000": jnp.zeros(4)}, "momenta": {"w0000": jnp.zeros(4)}}
    np.testing.assert_array_equal(store.load_outer(1, target)["theta"]["w0000"], np.arange(4.0))
    data = [p for p in store.outer_dir(1).rglob("*") if p.is_file()
            and p.name != "_CHECKPOINT_METADATA" and p.stat().st_size > 0]
    biggest = max(data, key=lambda p: p.stat().st_size)
    raw = bytearray(biggest.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    biggest.write_bytes(bytes(raw))
    with pytest.raises(StoreError, match="outer state of round 1 .* is damaged"):
        store.load_outer(1, target)


def test_old_rounds_are_forgotten_but_the_newest_outer_state_before_them_is_kept(tmp_path):
    store = Store(tmp_path, 0)
    store.check_writable()
    for r in range(1, 7):
        (store.round_dir(r) / "group-0").mkdir(parents=True)
        (store.round_dir(r) / "group-0.json").write_text("{}")
        store.propose(r, [0])
        (tmp_path / "outer" / f"{r}.json").write_text("{}")
        (tmp_path / "outer" / f"{r:06d}").mkdir()
    store.forget_before(5)
    assert store.outer_rounds() == [4, 5, 6]
    assert [r for r in range(1, 7) if store.published(r)] == [5, 6]
    assert not list(store.round_dir(4).glob("group-*"))
    assert store.closed_rounds() == [1, 2, 3, 4, 5, 6]  # the history of who took part


def test_the_supervisor_refuses_bad_flags_before_starting_anything(tmp_path):
    for kwargs, named in [({"groups": 0}, "--replica-groups"), ({"spares": -1}, "--spare-groups"),
                          ({"processes": 0}, "--processes-per-group"),
                          ({"min_groups": 3}, "--min-groups"),
                          ({"deadline": 0}, "--round-deadline"),
                          ({"mode": "eager"}, "--replica-mode"),
                          ({"max_restarts": -1}, "--max-restarts")]:
        with pytest.raises(ValueError, match=named):
            supervise(["true"], **dict(dict(groups=2, store=str(tmp_path)), **kwargs))


def test_a_store_no_group_can_write_is_an_error_before_training(tmp_path):
    locked = tmp_path / "a-file"  # a path under a file: no one can create it, root neither
    locked.write_text("")
    result = subprocess.run(
        [sys.executable, "-m", "kdist.launch", "--replica-groups", "2", "--replica-store",
         str(locked / "store"), str(ROOT / "tests" / "multihost_script.py"), "groups",
         "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2
    assert "--replica-store: The replica store" in result.stderr
    assert "not writable" in result.stderr and "group 0 rank" not in result.stdout


def test_the_report_names_each_failure_its_round_and_when_the_group_rejoined(tmp_path):
    import json

    from kdist.groups.history import job_lines, round_lines

    store = Store(tmp_path, 0)
    store.check_writable()
    store.manifest({"groups": 2})
    for r, members in ((1, [0, 1]), (2, [0]), (3, [0, 1])):
        store.propose(r, members, waited=0.5 * r)
    failed_at = time.time()
    (tmp_path / "events.jsonl").write_text(json.dumps(
        {"event": "failure", "group": 1, "status": 137, "action": "restart", "round": 1,
         "time": failed_at}) + "\n")
    Store(tmp_path, 1).record_join(2)
    lines = job_lines(tmp_path)
    assert lines[0].startswith("replica groups: 2 groups, 3 rounds closed (newest 3)")
    assert "members per round: 2 groups in 2 rounds, 1 groups in 1 rounds" in lines
    failure = next(x for x in lines if x.startswith("failure"))
    assert failure.startswith("failure: group 1 at round 1 (status 137): restart, rejoined "
                              "at round 2 after ")
    rows = [{"kind": "interval", "rounds": [
        {"join": 2, "group": 1},
        {"round": 3, "members": [0, 1], "seconds": 0.3, "waited": 0.2, "behind": False,
         "group": 1},
        {"round": 4, "members": [], "seconds": 0.1, "waited": 0.0, "behind": True,
         "group": 1}]}]
    assert round_lines(rows) == [
        "replica rounds: 2 (this group in 1, behind 1 times); per round 0.20 s on the host "
        "median, 0.10 s waiting for the quorum median / 0.20 s max",
        "joined the job at round 2"]


class _Restored:
    """A Checkpoint that restored ``step``: records where skip_to_job moves it."""

    def __init__(self, step):
        self.step, self.skipped_to = step, None

    def skip_to(self, step, model):
        self.skipped_to = self.step = step
        return step


def test_a_rejoining_group_skips_to_the_jobs_step_keeping_one_round(tmp_path, monkeypatch):
    """A group whose own checkpoint is behind the job's newest outer state goes on from that
    state's step (the furthest member's), a multiple of the round's fit batches, and keeps
    at least one round of its steps; one already there, or outside a group job, stays."""
    from types import SimpleNamespace

    from kdist.groups import skip_to_job

    model = SimpleNamespace(optimizer=SimpleNamespace(sync_every=5, accumulation=2))
    monkeypatch.setenv("KDIST_REPLICA_GROUP", "1")
    monkeypatch.setenv("KDIST_REPLICA_GROUPS", "2")
    monkeypatch.setenv("KDIST_REPLICA_STORE", str(tmp_path))
    (tmp_path / "outer").mkdir()
    assert skip_to_job(_Restored(0), model, total_steps=200) == 0  # a new job
    for r, steps in [(3, [30, 30]), (7, [60, 70])]:  # round 7: members at 60 and 70
        (tmp_path / "outer" / f"{r}.json").write_text(json.dumps({"steps": steps}))
    for restored, total, expected in [(20, 200, 70), (0, 200, 70), (70, 200, 70),
                                      (90, 200, 90), (20, 75, 60), (20, 10, 20)]:
        checkpoint = _Restored(restored)
        assert skip_to_job(checkpoint, model, total_steps=total) == expected, \
            (restored, total)
        assert checkpoint.skipped_to == (expected if expected > restored else None)
    monkeypatch.delenv("KDIST_REPLICA_GROUP")
    monkeypatch.delenv("KDIST_REPLICA_GROUPS")
    monkeypatch.delenv("KDIST_REPLICA_STORE")
    assert skip_to_job(_Restored(20), model, total_steps=200) == 20

"""Issue 46: replica groups that cannot diverge silently. Each test forces one failure of
the fault trials at the unit level, without a training job: a storage call delayed or
failing (monkeypatched, as a slow or full disk would), a record deleted, a file truncated;
the outer step runs on a stand-in model of one weight (kdist.groups.sync on the host)."""

import errno
import os
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from kdist.groups import store as store_module
from kdist.groups import store_io
from kdist.groups import supervisor as supervisor_module
from kdist.groups.host import guard_output, say
from kdist.groups.store import Store, StoreError
from kdist.groups.sync import OuterSync
from kdist.parallel.group_jobs import REFUSED, JobGroups, local_spec

VALUES = np.arange(4.0, dtype=np.float32)


def tree(values):
    return {"w0000": jnp.asarray(values, dtype=jnp.float32)}


def target():
    return {"w0000": jnp.zeros(4, jnp.float32)}


# --- a round is written once ---

def test_a_restarted_group_never_rewrites_a_round_it_committed(tmp_path, monkeypatch):
    """Group 0 committed round 3, then was killed; restarted from an older checkpoint, it
    publishes round 3 again — while a slow reader sits between the round's marker and its
    data. The reader still gets the committed values, and the entry is never rewritten
    (before: deleted and rewritten in place, so the reader read other values or called
    the round damaged)."""
    store = Store(tmp_path, 0)
    store.check_writable()
    first = store.publish(3, tree(VALUES), {"step": 6})
    verify = store_module._verify
    calls = []

    def slow_verify(root, meta, what):  # the reader holds the marker: the restart runs now
        if not calls:
            calls.append(Store(tmp_path, 0).publish(3, tree(VALUES + 100), {"step": 4}))
        return verify(root, meta, what)

    monkeypatch.setattr(store_module, "_verify", slow_verify)
    read = Store(tmp_path, 1).read(3, 0, target())
    np.testing.assert_array_equal(read["w0000"], VALUES)
    assert calls[0]["attempt"] == first["attempt"] and calls[0]["step"] == 6  # it stood
    assert store.committed(3) == first
    assert [p.name for p in store.round_dir(3).iterdir() if p.is_dir()] == \
        [f"group-0.{first['attempt']}"]  # the second attempt's directory is gone


def test_a_round_closed_again_after_its_record_was_lost_keeps_its_members(tmp_path):
    """Round 5 closed with group 0 alone and its outer state was committed; its quorum
    record was then lost. A stalled group 1 closing it again as [0, 1] (before: a second
    membership, the groups stepped apart) gets the committed members back."""
    a, b = Store(tmp_path, 0), Store(tmp_path, 1)
    a.check_writable()
    assert a.propose(5, [0])["members"] == [0]
    a.save_outer(5, {"theta": tree(VALUES), "momenta": tree(VALUES * 0)},
                 {"members": [0], "digest": "x"})
    (a.round_dir(5) / "quorum.json").unlink()
    record = b.propose(5, [0, 1], waited=8.0)
    assert record["members"] == [0] and record["restored_from"] == "outer/5.json"
    assert b.quorum(5) == record


# --- the outer step on a stand-in model: one weight of 4 values ---

def group(tmp_path, index, **job):
    """An OuterSync of group ``index`` over a model of one weight; its state."""
    optimizer = types.SimpleNamespace(
        groups=types.SimpleNamespace(momenta=[0], params=[1], schedule=None),
        outer_learning_rate=0.7, outer_momentum=0.9, outer_nesterov=True)
    sync = OuterSync(types.SimpleNamespace(optimizer=optimizer),
                     JobGroups(index, 2, str(tmp_path), **job))
    sync.fingerprint = {}
    return sync


def state(theta, inner):
    theta = jnp.asarray(theta, jnp.float32)
    return ([theta], [], [jnp.zeros(4, jnp.float32), jnp.asarray(inner, jnp.float32)[None]],
            [])


def rounds_3_and_4(tmp_path, final=False):
    """Group 0 commits round 3's outer state, both groups publish round 4 (group 0 from
    the last step of its fit when ``final``), group 0 closes and commits it. Returns group
    0's weights after round 4."""
    zero = group(tmp_path, 0)
    zero.store.check_writable()
    s = state(VALUES, VALUES)
    zero._commit(3, s[0], [s[2][0]], [0], {}, "d3")
    zero.applied = 3
    for g, delta in ((0, 0.5), (1, -0.25)):
        Store(tmp_path, g).publish(4, tree(np.full(4, delta)),
                                   {"step": 8, "base": 3, "final": final and g == 0})
    record = zero.store.propose(4, [0, 1])
    after = zero._step(s, 4, record)
    return np.asarray(after[0][0])


@pytest.mark.parametrize("damage", ["truncated data file", "emptied marker"])
def test_a_damaged_newest_outer_state_is_set_aside_and_rebuilt(tmp_path, capsys, damage):
    """Round 4's outer state is damaged (a data file cut in half; or its marker emptied, 0
    bytes). A group joining sets it aside (named), takes round 3's and replays round 4's
    committed gradients: the same weights as the committer's, bit for bit, and round 4 is
    committed again (before: every restart stopped at "is damaged", or a bare
    JSONDecodeError with no path)."""
    expected = rounds_3_and_4(tmp_path)
    store = Store(tmp_path, 1)
    if damage == "emptied marker":
        (tmp_path / "outer" / "4.json").write_text("")
        with pytest.raises(StoreError, match=r"4\.json is damaged: 0 bytes"):
            store.outer_meta(4)
    else:
        data = max((p for p in store.outer_dir(4).rglob("*") if p.is_file()
                    and p.name != "_CHECKPOINT_METADATA"),
                   key=lambda p: p.stat().st_size)
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    one = group(tmp_path, 1)
    joined = one._catch_up(state(np.zeros(4), np.zeros(4)), 4)
    np.testing.assert_array_equal(np.asarray(joined[0][0]), expected)
    out = capsys.readouterr().out
    assert "is damaged" in out and "Moved it aside to" in out, out
    assert "the outer state of round 4 rebuilt" in out
    assert list((tmp_path / "outer" / "damaged").iterdir())
    assert store.durable_outer() == 4 and store.outer_meta(4)["members"] == [0, 1]
    assert one.pending == {}  # checked against the commit


def test_an_applied_outer_state_that_differs_from_the_committed_one_names_the_round(
        tmp_path):
    """Group 1 applied round 4 with other members than the committed state's (a second
    closer): an error naming the round, never a silent exit 0."""
    rounds_3_and_4(tmp_path)
    one = group(tmp_path, 1)
    one.applied = 4
    one.pending[4] = ("0123456789abcdef", [0, 1])  # another fingerprint, as if stepped apart
    with pytest.raises(StoreError, match=r"Round 4: the outer state group 1 applied .* "
                                         r"differs from the one committed"):
        one._verify_pending()


def test_a_restarted_group_reuses_its_committed_gradient_instead_of_publishing(tmp_path,
                                                                                capsys):
    rounds_3_and_4(tmp_path)
    one = group(tmp_path, 1)
    before = one.store.committed(4)
    assert one._publish(4, tree(VALUES), {"step": 2, "base": 3}) is False
    assert one.store.committed(4) == before
    assert "committed by an earlier attempt" in capsys.readouterr().out


# --- a group behind the job's step ends with the job ---

def test_a_group_behind_the_job_ends_with_its_last_round_instead_of_training_alone(
        tmp_path, capsys):
    """Group 0 ended the job at round 4 (the last step of its fit). Group 1, which rejoined
    behind the job's step, still has steps: whether it is a round behind or holds round 4
    already, it ends with the job's outer weights and stops fit — no round 5 alone (before:
    it trained the last rounds alone, its final weights 0.04-0.05 from the others')."""
    expected = rounds_3_and_4(tmp_path, final=True)
    for applied, inner in ((3, VALUES + 1), (4, VALUES + 2)):
        one = group(tmp_path, 1)
        one.model.stop_training = False
        s = state(VALUES if applied == 3 else expected, inner)
        one.applied = applied
        ended = one.round(s, step=12)
        np.testing.assert_array_equal(np.asarray(ended[0][0]), expected)
        np.testing.assert_array_equal(np.asarray(ended[2][1][0]), expected)  # inner reset
        assert one.model.stop_training and one.ended == 4
        assert one.round(ended, step=13) is ended  # the steps fit still runs: no round
        assert not Store(tmp_path, 1).round_dir(5).exists()
    assert "the job ended at round 4" in capsys.readouterr().out


# --- a full or read-only store ---

def failing_writes(monkeypatch, failures, code=errno.ENOSPC):
    """The store's ``write_json`` fails ``failures`` times (``None``: always) with ``code``."""
    real, count = store_module.write_json, []

    def write(*args, **kwargs):
        if failures is None or len(count) < failures:
            count.append(1)
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    monkeypatch.setattr(store_module, "write_json", write)
    return count


def test_a_full_store_is_waited_for_then_named(tmp_path, monkeypatch, capsys):
    store = Store(tmp_path, 0)
    store.check_writable()
    failing_writes(monkeypatch, 2)
    assert store.propose(1, [0])["members"] == [0]  # written once the space came back
    out = capsys.readouterr().out
    assert f"store full / read-only at {store.round_dir(1) / 'quorum.json'}" in out
    assert "writable again" in out
    failing_writes(monkeypatch, None, errno.EROFS)
    monkeypatch.setattr(store_io, "STORE_WAIT", 0.3)
    with pytest.raises(StoreError, match=r"stayed full or read-only .*: the quorum record of "
                                         r"round 2 was not written"):
        store.propose(2, [0])


class FakeChild:
    """A group's process that already exited with ``code``."""

    def __init__(self, code):
        self.returncode, self.pid = code, 12345

    def poll(self):
        return self.returncode

    terminate = kill = wait = poll


def test_the_supervisor_survives_a_full_store(tmp_path, monkeypatch, capsys):
    """A group fails while the store is full: the supervisor cannot mark its heartbeat dead
    nor append the event (before: a raw OSError ended the supervisor and every group). It
    says so and goes on."""
    sup = supervisor_module.Supervisor(["true"], 1, 0, 1, 4, str(tmp_path), 1, 60.0,
                                       "quorum", 0, 1.0)
    Store(tmp_path, -1).check_writable()
    failing_writes(monkeypatch, None)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(supervisor_module, "open", full, raising=False)
    monkeypatch.setattr(supervisor_module, "STORE_WAIT", 0.2)
    group = sup.groups[0]
    group.children = [FakeChild(1)]
    sup.failed(group, group.children[0])
    out = capsys.readouterr().out
    assert group.state == "lost"
    assert "heartbeat not marked dead" in out and "store full / read-only" in out
    assert "event not recorded" in out and "the group is lost" in out


def test_output_to_a_closed_pipe_never_raises(monkeypatch):
    """The supervisor died: a group's stdout is a pipe nobody reads. A round's line (and
    any print after it, the SIGTERM save's among them) must not raise, or the save the
    SIGTERM asked for is lost."""
    read, write = os.pipe()
    os.close(read)
    broken = os.fdopen(write, "w")
    monkeypatch.setattr(sys, "stdout", broken)
    monkeypatch.setattr(sys, "stderr", sys.stderr)  # restored after guard_output wraps it
    say("outer state of round 3 durable")  # before: BrokenPipeError
    guard_output()
    print("Checkpoint: step 9 committed", flush=True)
    print("and after", flush=True)
    sys.stdout.flush()
    broken.close()


# --- refusals ---

@pytest.mark.parametrize("flags, named", [
    (["--replica-groups", "3", "S", "--mesh", "replica=2,data=4"],
     "replica=2 but --replica-groups is 3"),
    (["--replica-groups", "2", "--devices-per-process", "3", "S", "--mesh", "replica=2,data=4"],
     "--devices-per-process 3 gives it 3"),
    (["--replica-groups", "2", "S", "--mesh", "replica=2,data=4", "--host-devices", "8"],
     "--host-devices 8 inside groups of --devices-per-process 4"),
    (["--replica-groups", "2", "--processes", "2", "S"], "--processes 2 is one JAX job's"),
    (["--replica-groups", "2", "--replica-mode", "async", "--min-groups", "2", "S"],
     "--min-groups 2: quorum rounds only"),
    (["--replica-groups", "2", "--replica-mode", "async", "--round-deadline", "5", "S"],
     "--round-deadline 5: quorum rounds only"),
    (["--replica-groups", "2", "--round-deadline", "inf", "S"],
     "--round-deadline must be a finite number"),
])
def test_the_launcher_refuses_flags_that_disagree_naming_them(tmp_path, capsys, flags, named):
    from kdist import launch

    flags = [f if f != "S" else str(tmp_path / "script.py") for f in flags]
    with pytest.raises(SystemExit) as exit_:
        launch.main(["--replica-store", str(tmp_path / "store"), *flags])
    err = capsys.readouterr()
    assert exit_.value.code == 2 and named in err.err, err
    assert "rank" not in err.out  # no group started
    assert not (tmp_path / "store").exists()


def test_a_configuration_error_in_a_group_exits_refused(capsys):
    """A group whose mesh is not the job's exits with status 78, which the supervisor does
    not restart (before: a ValueError, status 1, restarted up to --max-restarts)."""
    job = JobGroups(0, 2, "/s")
    with pytest.raises(SystemExit) as exit_:
        local_spec("replica=3,data=4", job)
    assert exit_.value.code == REFUSED and isinstance(exit_.value, ValueError)
    assert "refused: Mesh spec 'replica=3,data=4' has replica=3" in capsys.readouterr().err


def test_the_report_says_how_far_behind_the_job_a_group_rejoined(tmp_path):
    import json

    from kdist.groups.history import job_lines

    store = Store(tmp_path, 1)
    store.check_writable()
    (tmp_path / "events.jsonl").write_text(json.dumps(
        {"event": "failure", "group": 1, "status": 137, "action": "restart", "round": 3,
         "time": 0.0}) + "\n")
    store.record_join(4, step=10, job_step=16)
    failure = next(x for x in job_lines(tmp_path) if x.startswith("failure"))
    assert failure.endswith(", 6 steps behind the job's step"), failure

"""Multi-process training on 127.0.0.1: kdist.initialize, kdist.launch, per-process data.

The multi-process runs go through ``kdist.launch`` with ``tests/multihost_script.py``; the
one-process reference calls the same function of that script in this (8-device) process.
"""

import argparse
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import kdist
from kdist import launch
from kdist.parallel.mesh import MESH_AXES
from tests import multihost_script
from tests.helpers import CLUSTER_VARIABLES, ROOT, ProcessOutput, child_environment

SCRIPT = str(ROOT / "tests" / "multihost_script.py")



@pytest.mark.slow
@pytest.mark.xdist_group("multihost")  # one worker launches the processes once
def test_every_process_uses_process_zeros_word_piece_vocabulary(multihost_cases):
    # Two trainings of one corpus can keep different tokens (the HF trainer breaks ties in
    # hash order): processes must not each train their own.
    ranks = multihost_cases.ranks("wordpiece")
    assert ranks[0]["vocabulary"] == ranks[1]["vocabulary"] == ranks[0]["cached"]
    assert ranks[1]["cached"] == ranks[0]["cached"]  # the stale cache entry was replaced
    assert "stale" not in ranks[1]["vocabulary"] and len(ranks[0]["vocabulary"]) > 100


@pytest.mark.slow
@pytest.mark.parametrize("mesh, shares", [("fsdp=8", 2), ("data=2,model=4", 2), ("model=8", 1)])
@pytest.mark.xdist_group("multihost")  # one worker launches the processes once
def test_two_processes_train_like_one(mesh, shares, multihost_cases):
    """``shares``: distinct row sets per step. Under model=8 the one replica spans both
    processes, so each must feed the whole (identical) global batch."""
    ranks = multihost_cases.ranks(f"train {mesh}")
    assert [(r["process_index"], r["process_count"], r["devices"], r["local_devices"])
            for r in ranks] == [(0, 2, 8, 4), (1, 2, 8, 4)]

    # The same script in one process of 8 devices, reusing the cache the ranks wrote.
    args = argparse.Namespace(mesh=mesh, steps=3, out=str(multihost_cases.out(f"train {mesh}")))
    reference = multihost_script.train(args)
    assert reference["devices"] == 8 and reference["mesh"] == ranks[0]["mesh"] == mesh
    for rank in ranks:
        np.testing.assert_allclose(rank["losses"], reference["losses"], rtol=2e-6)
    assert reference["losses"][2] < reference["losses"][0]  # it trained

    local = multihost_script.GLOBAL_BATCH_SIZE // shares
    for step in map(str, range(3)):
        rows = [np.asarray(r["rows"][step]) for r in ranks]
        assert all(r.shape == (local, multihost_script.SEQUENCE_LENGTH) for r in rows)
        if shares == 2:  # disjoint windows, together exactly the global batch, in order
            assert not set(ranks[0]["windows"][step]) & set(ranks[1]["windows"][step])
            np.testing.assert_array_equal(np.concatenate(rows), reference["rows"][step])
        else:  # both feed the global batch
            for r in rows:
                np.testing.assert_array_equal(r, reference["rows"][step])


@pytest.mark.slow
@pytest.mark.xdist_group("multihost")  # one worker launches the processes once
@pytest.mark.parametrize("mesh, expected", [
    # model fastest-varying: each host holds whole model groups; data spans the hosts.
    ("data=2,model=4", [{"data": [r], "fsdp": [0], "model": [0, 1, 2, 3]} for r in (0, 1)]),
    ("data=2,fsdp=2,model=2",
     [{"data": [r], "fsdp": [0, 1], "model": [0, 1]} for r in (0, 1)]),
])
def test_device_order_keeps_model_inside_a_host_and_data_across(mesh, expected,
                                                                multihost_cases):
    for rank, seen in enumerate(multihost_cases.ranks(f"devices {mesh}")):
        assert seen["process_index"] == rank
        # Axes of size 1 (replica, stage, seq here) have the one coordinate 0.
        assert seen["coords"] == {axis: expected[rank].get(axis, [0]) for axis in MESH_AXES}


class Launched(ProcessOutput):
    """``python -m kdist.launch ARGS`` in the background, its output read as it comes."""

    def __init__(self, *args):
        super().__init__(subprocess.Popen(
            [sys.executable, "-m", "kdist.launch", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        ))

    def pids(self) -> dict[int, int]:
        return {int(x.split()[2]): int(x.split()[4]) for x in self.lines
                if x.startswith("[launch] rank ") and x.split()[3] == "pid"}


def both_ready(lines):
    return {x[:3] for x in lines if "ready" in x} == {"[0]", "[1]"}


def test_launcher_ends_the_others_when_one_is_killed(tmp_path, child_env):
    run = Launched("--processes", "2", "--devices-per-process", "2", "--grace", "5",
                   SCRIPT, "hang", "--mesh", "data=4", "--out", str(tmp_path))
    run.wait_for(both_ready)  # both joined the cluster and run cross-process barriers
    pids = run.pids()
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    status, output = run.finish(timeout=60)
    elapsed = time.monotonic() - killed_at
    assert status == 128 + signal.SIGKILL, output
    assert "[launch] rank 1 exited with status 137" in output
    assert elapsed < 5 + 5  # the grace period, plus polling and exit
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)  # rank 0 is gone too


def test_launcher_stops_the_others_when_one_fails(tmp_path, child_env):
    """Rank 1 exits 3 at once; rank 0 ignores SIGTERM and would sleep for a minute. The
    launcher says it stops the others, sends SIGTERM, SIGKILLs rank 0 after the grace period
    and exits with rank 1's status. (No JAX in the children: nothing else can end rank 0.)"""
    child = tmp_path / "child.py"
    child.write_text(
        "import os, signal, sys, time\n"
        "if os.environ['KERAS_DISTRIBUTION_PROCESS_ID'] == '1':\n"
        "    time.sleep(1)\n"
        "    sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, lambda *_: print('ignoring SIGTERM', flush=True))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    run = Launched("--processes", "2", "--devices-per-process", "1", "--grace", "2", str(child))
    run.wait_for(lambda lines: any("exited with status" in x for x in lines), timeout=60)
    failed_at = time.monotonic()
    status, output = run.finish(timeout=30)
    assert status == 3, output
    assert "[launch] rank 1 exited with status 3; stopping the others" in output
    assert "[0] ignoring SIGTERM" in output  # it was asked first ...
    assert time.monotonic() - failed_at < 2 + 3  # ... and killed after the grace period
    with pytest.raises(ProcessLookupError):
        os.kill(run.pids()[0], 0)


@pytest.mark.parametrize("mode", ["ranks", "groups"])
def test_a_killed_launcher_leaves_nothing_running(tmp_path, child_env, mode):
    """SIGKILL to the launcher (nothing of it runs then): the kernel SIGTERMs every process
    it started — ranks, or every process of every replica group — which, asked to stop,
    would save and exit (here: leave a file)."""
    child = tmp_path / "child.py"
    child.write_text(
        "import os, signal, sys, time\n"
        "def stop(*_):\n"
        f"    open(os.path.join({str(tmp_path)!r}, f'{{os.getpid()}}.term'), 'w').close()\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('ready', os.getpid(), flush=True)\n"
        "time.sleep(120)\n"
    )
    flags = (["--processes", "2"] if mode == "ranks" else
             ["--replica-groups", "2", "--processes-per-group", "2",
              "--replica-store", str(tmp_path / "store")])
    count = 2 if mode == "ranks" else 4
    run = Launched(*flags, "--devices-per-process", "1", str(child))
    run.wait_for(lambda lines: sum("ready" in x for x in lines) == count, timeout=60)
    pids = [int(x.split()[-1]) for x in run.lines if " ready " in x]
    os.kill(run.proc.pid, signal.SIGKILL)
    run.finish(timeout=30)
    until = time.monotonic() + 10
    while any(_running(pid) for pid in pids) and time.monotonic() < until:
        time.sleep(0.05)
    assert not [pid for pid in pids if _running(pid)]
    assert sorted(int(p.stem) for p in tmp_path.glob("*.term")) == sorted(pids)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) is gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_launcher_blames_the_killed_rank_when_several_fail_in_one_poll():
    # A survivor often errors in the same 50 ms poll as the rank that was killed (its peer
    # vanished); reporting the lowest failed rank would blame the survivor and exit 1.
    rank = lambda code: argparse.Namespace(returncode=code)  # noqa: E731
    children = [rank(1), rank(-signal.SIGKILL), rank(None)]
    assert launch._cause(children) is children[1]
    assert launch._cause([rank(0), rank(2), rank(3)]).returncode == 2  # first exit status
    assert launch._cause([rank(0), rank(None)]) is None


def test_launcher_forwards_sigterm_and_prefixes_output(tmp_path, child_env):
    child = tmp_path / "child.py"
    child.write_text(
        "import os, signal, sys\n"
        "rank = os.environ['KERAS_DISTRIBUTION_PROCESS_ID']\n"
        "def stop(signum, frame):\n"
        "    open(os.path.join(sys.argv[1], 'term' + rank), 'w').write(str(signum))\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('ready', os.environ['KERAS_DISTRIBUTION_NUM_PROCESSES'],\n"
        "      [f for f in os.environ['XLA_FLAGS'].split() if 'count' in f][0],\n"
        "      'eigen=false' in os.environ['XLA_FLAGS'], flush=True)\n"
        "signal.alarm(120)  # a bound, should the launcher never forward the signal\n"
        "signal.pause()  # until the forwarded SIGTERM\n"
    )
    run = Launched("--processes", "2", "--devices-per-process", "3", str(child), str(tmp_path))
    run.wait_for(both_ready)
    assert sorted(x for x in run.lines if "ready" in x) == [
        f"[{r}] ready 2 --xla_force_host_platform_device_count=3 True\n" for r in (0, 1)
    ]
    run.proc.send_signal(signal.SIGTERM)
    status, output = run.finish(timeout=30)
    assert status == 128 + signal.SIGTERM, output
    assert [(tmp_path / f"term{r}").read_text() for r in (0, 1)] == [str(signal.SIGTERM)] * 2


def test_initialize_is_a_no_op_in_one_process(monkeypatch):
    for name in CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    info = kdist.initialize()
    assert (info.process_index, info.process_count, info.device_count) == (0, 1, 8)
    assert not jax.distributed.is_initialized()
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "1")  # one process, said explicitly
    assert kdist.initialize().process_count == 1 and not jax.distributed.is_initialized()


def test_initialize_reads_a_slurm_job(monkeypatch):
    for name in CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    slurm = dict(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="node[003-004]", SLURM_NTASKS="1",
                 SLURM_PROCID="0", SLURM_LOCALID="0")
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    assert kdist.initialize().process_count == 1  # a one-task job: nothing to join
    monkeypatch.setenv("SLURM_NTASKS", "2")  # a real cluster: it would join (too late here)
    with pytest.raises(RuntimeError, match="must run before JAX starts its devices"):
        kdist.initialize()


def test_initialize_checks_its_arguments_before_connecting(monkeypatch):
    for name in CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="process_id=2 is outside 0..1"):
        kdist.initialize("127.0.0.1:1234", num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="not of the form HOST:PORT"):
        kdist.initialize("localhost", num_processes=2, process_id=0)
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match="no coordinator address .* no process id"):
        kdist.initialize()
    # In this process JAX has started its devices already: too late to join a cluster.
    with pytest.raises(RuntimeError, match="must run before JAX starts its devices"):
        kdist.initialize("127.0.0.1:1234", num_processes=2, process_id=1)


def test_initialize_fails_clearly_and_in_bounded_time(child_env):
    """Process 1 with no coordinator: ConnectionError. Process 0 whose peer never comes:
    JAX aborts the process at the timeout, and kdist says why just before."""
    ports = {0: launch.free_port()}  # nobody listens there
    while ports.setdefault(1, launch.free_port()) == ports[0]:  # two different clusters
        del ports[1]
    code = ("import kdist; "
            "kdist.initialize('127.0.0.1:{}', num_processes=2, process_id={}, timeout=5)")
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", code.format(ports[rank], rank)],
                              stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env=child_environment(JAX_PLATFORMS="cpu")) for rank in (1, 0)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert time.monotonic() - start < 90  # imports (slow on a busy machine) + 5 s + exit
    assert all(p.returncode != 0 for p in procs)
    assert (f"ConnectionError: Process 1 of 2 could not reach the coordinator at "
            f"127.0.0.1:{ports[1]} within 5 s") in errors[0]
    assert (f"the cluster at 127.0.0.1:{ports[0]} has not formed after 5 s (this is process 0 "
            f"of 2)") in errors[1]

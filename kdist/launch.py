"""Local multi-process launcher: N JAX processes on 127.0.0.1, each with its own CPU devices.

    python -m kdist.launch --processes 2 --devices-per-process 4 recipes/gpt_pretrain.py --steps 20
    python -m kdist.launch --processes 2 -m pytest ...        # a module instead of a script
    python -m kdist.launch --replica-groups 2 --devices-per-process 4 SCRIPT  # kdist.groups

Each process gets the host-device settings of ``kdist.force_host_devices(D)``, Keras' variables
``KERAS_DISTRIBUTION_JOB_ADDRESSES`` (a free port on 127.0.0.1), ``_NUM_PROCESSES`` and
``_PROCESS_ID`` (read by :func:`kdist.initialize`), and gloo for CPU collectives. Output lines
are prefixed by rank (``[0] ...``). SIGINT and SIGTERM are forwarded to every process. If one
process exits with an error (or is killed), the others get SIGTERM, then SIGKILL after
``--grace`` seconds, and the launcher exits non-zero: a crashed rank never leaves the rest
waiting forever in a collective. The exit status is that of the first process that failed
(128 + signal number for a signal), else 0. If the launcher itself is killed (SIGKILL: nothing
of it runs), the kernel SIGTERMs its processes (Linux; :func:`kdist.local_processes.start`):
none trains on unsupervised.

This is for developing and testing multi-process code on one machine; on a cluster, start
one process per host with the cluster's own launcher (see docs/multihost.md).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time

from kdist.local_processes import copy_output, free_port, process_env, start  # noqa: F401  (process_env: as before)


def _status(code: int) -> int:
    return 128 - code if code < 0 else code  # -9 (killed by SIGKILL) -> 137, as a shell says


def _cause(children: list) -> subprocess.Popen | None:
    """The failed rank to report among those seen failed in one poll, or None.

    A rank a signal ended (a kill, the OOM killer) is the cause; the others usually failed
    because it vanished, and may have exited within the same poll.
    """
    failures = [c for c in children if c.returncode not in (None, 0)]
    return min(failures, key=lambda c: c.returncode >= 0) if failures else None


def launch(
    command: list[str], processes: int = 2, devices_per_process: int = 4, grace: float = 10.0
) -> int:
    """Runs ``command`` (``[python, script, args...]``) as ``processes`` ranks; returns the status.

    Example:
        >>> import sys
        >>> launch([sys.executable, "-c", "print('hi')"], processes=2, devices_per_process=1)
        0
    """
    if processes < 1 or devices_per_process < 1:
        raise ValueError(
            f"--processes ({processes}) and --devices-per-process ({devices_per_process}) must "
            f"be positive integers."
        )
    port = free_port()
    lock = threading.Lock()
    children: list[subprocess.Popen] = []
    pumps = []
    for rank in range(processes):
        child = start(command, process_env(rank, processes, devices_per_process, port))
        children.append(child)
        with lock:
            print(f"[launch] rank {rank} pid {child.pid}", flush=True)
        pump = threading.Thread(target=copy_output, args=(str(rank), child.stdout, lock),
                                daemon=True)
        pump.start()
        pumps.append(pump)

    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    try:
        kill_at = None  # once set: SIGKILL whatever still runs at that time
        while True:
            running = [c.poll() for c in children].count(None)  # poll every child, each time
            first = _cause(children) if kill_at is None else None
            if first is not None:  # also when every rank ended within the same poll
                status = _status(first.returncode)
                with lock:
                    print(f"[launch] rank {children.index(first)} exited with status "
                          f"{status}" + ("; stopping the others" if running else ""), flush=True)
                for child in children:
                    if child.poll() is None:
                        child.terminate()
                kill_at = time.monotonic() + grace
            elif kill_at is None and received:  # forwarded; a rank that ignores it dies later
                kill_at = time.monotonic() + grace
            elif kill_at is not None and time.monotonic() > kill_at:
                for child in children:
                    if child.poll() is None:
                        child.kill()
            if not running:
                break
            time.sleep(0.05)
        if received and status == 0:
            status = 128 + received[0]
    finally:
        for child in children:  # never leave a rank behind, whatever happened here
            if child.poll() is None:
                child.kill()
                child.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
        for pump in pumps:
            pump.join(timeout=5)
    return status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kdist.launch",
        description="Run a script as several JAX processes on this machine (CPU devices).",
    )
    p.add_argument("--processes", type=int, default=None,
                   help="number of processes (ranks); default 2")
    p.add_argument("--devices-per-process", type=int, default=4,
                   help="forced host (CPU) devices in each process")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when a rank fails")
    g = p.add_argument_group(
        "replica groups as separate jobs (kdist.groups: DiLoCo groups that survive each "
        "other; the script's mesh names replica=G and it passes sync_every)")
    g.add_argument("--replica-groups", type=int, default=None, metavar="G",
                   help="run G groups, each its own job, exchanging through --replica-store")
    g.add_argument("--spare-groups", type=int, default=0, metavar="K",
                   help="groups held back to replace a failed one")
    g.add_argument("--processes-per-group", type=int, default=1, metavar="P",
                   help="processes of each group (its own JAX cluster when P > 1)")
    g.add_argument("--replica-store", default="replica-store", metavar="DIR",
                   help="the directory every group reads and writes (shared storage)")
    g.add_argument("--min-groups", type=int, default=None,
                   help="fewest groups a round closes with; the job fails below it "
                        "(quorum rounds; default 1)")
    g.add_argument("--round-deadline", type=float, default=None, metavar="SECONDS",
                   help="how long a round waits for a running group's outer gradient "
                        "(quorum rounds; default 60)")
    g.add_argument("--replica-mode", default="quorum", choices=("quorum", "async"),
                   help="quorum: wait for every running group (up to the deadline); "
                        "async: never wait, stale gradients down-weighted")
    g.add_argument("--max-restarts", type=int, default=3,
                   help="restarts of a failed group once no spare is left")
    p.add_argument("-m", dest="module", default=None, help="run a module, like python -m")
    p.add_argument("script", nargs="?", help="the Python script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")
    args = p.parse_args(argv)
    if args.module:
        command = [sys.executable, "-m", args.module]
        command += [args.script] if args.script else []
    elif args.script:
        command = [sys.executable, args.script]
    else:
        p.error("give a SCRIPT (or -m MODULE) to run")
    if args.replica_groups is None:
        return launch(command + args.args, 2 if args.processes is None else args.processes,
                      args.devices_per_process, args.grace)
    # Flags that would be ignored are refused, naming them, before any group starts.
    if args.processes is not None:
        p.error(f"--processes {args.processes} is one JAX job's process count; with "
                f"--replica-groups each group's processes are --processes-per-group P.")
    if args.replica_mode == "async":
        typed = [f"{flag} {value:g}" for flag, value in (("--min-groups", args.min_groups),
                                                        ("--round-deadline",
                                                         args.round_deadline))
                 if value is not None]
        if typed:
            p.error(f"{' and '.join(typed)}: quorum rounds only; --replica-mode async never "
                    f"waits for a quorum. Leave {'them' if len(typed) > 1 else 'it'} out.")
    from kdist.groups.supervisor import supervise
    from kdist.parallel.group_jobs import DEFAULT_DEADLINE

    try:
        return supervise(command + args.args, args.replica_groups, args.spare_groups,
                         args.processes_per_group, args.devices_per_process,
                         args.replica_store,
                         1 if args.min_groups is None else args.min_groups,
                         DEFAULT_DEADLINE if args.round_deadline is None
                         else args.round_deadline,
                         args.replica_mode, args.max_restarts, args.grace)
    except ValueError as e:
        p.error(str(e))


if __name__ == "__main__":
    sys.exit(main())

"""A JAX process started on this machine: its environment (a free coordinator port, its
host devices, Keras' cluster variables and gloo), its start and its output — for
:mod:`kdist.launch` and the replica-group supervisor (:mod:`kdist.groups.supervisor`).

Example:
    >>> env = process_env(1, 2, 4, 12345, base={})
    >>> env["KERAS_DISTRIBUTION_PROCESS_ID"], env["KERAS_DISTRIBUTION_JOB_ADDRESSES"]
    ('1', '127.0.0.1:12345')
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading

from kdist.parallel.devices import host_device_environment


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(rank: int, processes: int, devices: int, port: int, base=None) -> dict:
    """The environment of process ``rank``: device count, coordinator, id, CPU collectives."""
    env = dict(os.environ if base is None else base)
    env.update(host_device_environment(devices, env))
    env.update(
        KERAS_DISTRIBUTION_JOB_ADDRESSES=f"127.0.0.1:{port}",
        KERAS_DISTRIBUTION_NUM_PROCESSES=str(processes),
        KERAS_DISTRIBUTION_PROCESS_ID=str(rank),
        JAX_PLATFORMS="cpu",
        JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
        PYTHONUNBUFFERED="1",
    )
    return env


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    except OSError:
        return None


def start(command: list[str], env: dict) -> subprocess.Popen:
    """Starts ``command`` as a process of ours: its own session (a terminal's Ctrl-C reaches
    us, and we forward it once), its output piped to us — and, on Linux, SIGTERMed by the
    kernel if we die, so a launcher killed with SIGKILL (nothing of ours runs then) leaves no
    rank or group training behind. SIGTERM, not SIGKILL: kdist's checkpoint callback saves
    the step and exits on it. Call it from the thread that lives as long as the launcher
    (the kernel's signal follows the thread that started the child)."""
    libc, parent = _libc(), os.getpid()

    def orphan_guard():  # in the child, between fork and exec: no imports, no locks
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # we died before the guard was set
            os._exit(128 + signal.SIGTERM)

    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=orphan_guard if libc is not None else None)


def copy_output(prefix: str, stream, lock: threading.Lock) -> None:
    """Copies one process's output to ours, line by line, prefixed ``[prefix] ``."""
    for line in iter(stream.readline, b""):
        text = line.decode("utf-8", errors="replace").rstrip("\n")
        with lock:
            sys.stdout.write(f"[{prefix}] {text}\n")
            sys.stdout.flush()
    stream.close()

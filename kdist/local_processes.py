"""The environment of a JAX process started on this machine: a free coordinator port,
its host devices, Keras' cluster variables and gloo — for :mod:`kdist.launch` and the
replica-group supervisor (:mod:`kdist.groups.supervisor`).

Example:
    >>> env = process_env(1, 2, 4, 12345, base={})
    >>> env["KERAS_DISTRIBUTION_PROCESS_ID"], env["KERAS_DISTRIBUTION_JOB_ADDRESSES"]
    ('1', '127.0.0.1:12345')
"""

from __future__ import annotations

import os
import socket
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


def copy_output(prefix: str, stream, lock: threading.Lock) -> None:
    """Copies one process's output to ours, line by line, prefixed ``[prefix] ``."""
    for line in iter(stream.readline, b""):
        text = line.decode("utf-8", errors="replace").rstrip("\n")
        with lock:
            sys.stdout.write(f"[{prefix}] {text}\n")
            sys.stdout.flush()
    stream.close()

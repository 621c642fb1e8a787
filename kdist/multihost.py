"""Multi-process start-up: ``kdist.initialize()`` joins this process to a JAX cluster.

Call it first in a training script, before anything touches a device. It reads the standard
environment, in this order:

1. explicit arguments;
2. Keras' variables ``KERAS_DISTRIBUTION_JOB_ADDRESSES`` (comma-separated; the first is the
   coordinator), ``KERAS_DISTRIBUTION_NUM_PROCESSES``, ``KERAS_DISTRIBUTION_PROCESS_ID``
   (what ``python -m kdist.launch`` sets), and JAX's ``JAX_COORDINATOR_ADDRESS``;
3. whatever JAX detects by itself: SLURM (``SLURM_*``), Open MPI (``OMPI_*``), Kubernetes
   indexed Jobs and TPU pod slices (the TPU metadata server).

With none of these, or with one process, it does nothing, so the same script runs on a
laptop and on a cluster. Otherwise it calls ``jax.distributed.initialize`` with a bounded
timeout, selects gloo for cross-process collectives on CPU devices, seeds Keras' RNG the same
in every process (as ``keras.distribution.initialize`` does), and checks that every process
agrees on the process count. An unreachable coordinator, an inconsistent process count or a
call after JAX already started are errors that say what to fix.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
import threading
import time

from kdist import _keras_compat

_ADDRESS = re.compile(r"^\[?[\w.:-]+\]?:\d+$")


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands in the cluster, as :func:`initialize` returns it."""

    process_index: int
    process_count: int
    local_device_count: int
    device_count: int
    coordinator_address: str | None = None


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"Environment variable {name}={value!r} must be an integer.") from None


def _cluster_detected():
    """The cluster environment JAX would auto-detect (SLURM, Open MPI, ...), or None."""
    for env in _keras_compat.cluster_environments():
        if getattr(env, "opt_in_only_method", False):
            continue
        try:
            if env.is_env_present():
                return env
        except Exception:  # a detector that cannot even look counts as absent
            continue
    return None


def _cluster_process_count(cluster) -> int | None:
    """The process count the cluster environment gives (a single-task job is one process)."""
    try:
        return int(cluster.get_process_count())
    except Exception:  # let jax.distributed.initialize find out, and report, itself
        return None


def process_info() -> ProcessInfo:
    """This process's index and the process and device counts (initialized or not).

    Example:
        >>> process_info().process_count
        1
    """
    import jax

    return ProcessInfo(
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_device_count=jax.local_device_count(),
        device_count=jax.device_count(),
        coordinator_address=_keras_compat.coordinator_address(),
    )


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout: int = 120,
    cpu_collectives: str = "gloo",
) -> ProcessInfo:
    """Joins this process to the cluster (``jax.distributed``); a no-op on one process.

    Args:
        coordinator_address: ``host:port`` of process 0. Default: from the environment
            (see the module docstring).
        num_processes: processes in the job. Default: from the environment.
        process_id: this process's index, ``0 .. num_processes - 1``.
        timeout: seconds to wait for the coordinator and the other processes before
            failing. JAX's own default is 300 s.
        cpu_collectives: cross-process collectives for CPU devices (``"gloo"``; ``"mpi"``
            needs an MPI library). Accelerators use their own (NCCL, ICI) regardless.

    Returns:
        The :class:`ProcessInfo` of this process.

    Example:
        >>> import kdist
        >>> kdist.initialize().process_count    # alone: nothing to join
        1
    """
    import jax

    if _keras_compat.distributed_client() is not None:  # already initialized: idempotent
        return process_info()

    addresses = os.environ.get("KERAS_DISTRIBUTION_JOB_ADDRESSES", "")
    if coordinator_address is None:
        coordinator_address = (addresses.split(",")[0].strip() or None) if addresses else None
    if coordinator_address is None:
        coordinator_address = os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    if num_processes is None:
        num_processes = _env_int("KERAS_DISTRIBUTION_NUM_PROCESSES")
    if process_id is None:
        process_id = _env_int("KERAS_DISTRIBUTION_PROCESS_ID")
    cluster = _cluster_detected()
    if num_processes is None and cluster is not None:
        num_processes = _cluster_process_count(cluster)  # e.g. SLURM_NTASKS

    configured = (coordinator_address, num_processes, process_id)
    if num_processes == 1 or (all(v is None for v in configured) and cluster is None):
        return process_info()  # one process: nothing to join

    cluster = None if cluster is None else cluster.__name__
    _check_arguments(coordinator_address, num_processes, process_id, timeout, cluster)
    if _keras_compat.jax_backends_started():
        raise RuntimeError(
            "kdist.initialize() must run before JAX starts its devices, but JAX already has "
            "(something called jax.devices(), created an array or built a Keras model). Call "
            "kdist.initialize() at the top of the script, right after the imports."
        )
    if cpu_collectives and not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
        # Without it, CPU devices of different processes cannot run collectives at all.
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)

    start = time.monotonic()
    if coordinator_address is not None and process_id not in (None, 0):
        # JAX's client aborts the whole process (a C++ fatal error, not an exception) when
        # the coordinator never answers; find out first, and raise something readable.
        _wait_for_coordinator(coordinator_address, process_id, num_processes, timeout)
    remaining = max(1, int(timeout - (time.monotonic() - start)))
    # JAX also aborts the process when the others do not all join in time (a missing
    # process, or one started with another count): say why just before that happens.
    watchdog = threading.Timer(max(0.5, remaining - 0.5), _say_why_it_hangs,
                               (coordinator_address or cluster, process_id, num_processes,
                                timeout))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=remaining,
        )
    finally:
        watchdog.cancel()

    _check_process_count(num_processes, timeout)
    _sync_keras_seed()
    _exit_at_once_on_uncaught_errors()
    return process_info()


def _exit_at_once_on_uncaught_errors() -> None:
    """An uncaught exception ends this process at once, with status 1.

    Otherwise JAX's exit handler waits at a shutdown barrier for the other processes, which
    are still training (or blocked in a collective waiting for this one): up to 5 minutes
    before the failure is visible to ``kdist.launch``, SLURM or Kubernetes, which then stop
    the whole job.
    """
    previous = sys.excepthook

    def report_and_exit(kind, value, traceback):
        previous(kind, value, traceback)  # the usual traceback, first
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    sys.excepthook = report_and_exit


def _wait_for_coordinator(address: str, process_id, num_processes, timeout: float) -> None:
    """Returns once ``address`` accepts TCP connections; ``ConnectionError`` after ``timeout``."""
    host, port = address.rsplit(":", 1)
    host = host.strip("[]")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"Process {process_id} of {num_processes} could not reach the coordinator "
                    f"at {address} within {timeout:g} s ({error}). Check that process 0 is "
                    f"running and was given the same address, that the host name resolves "
                    f"and the port is open between the hosts; raise `timeout` if process 0 "
                    f"starts slowly."
                ) from None
            time.sleep(0.25)


def _say_why_it_hangs(where, process_id, num_processes, timeout) -> None:
    print(
        f"kdist.initialize: the cluster at {where} has not formed after {timeout:g} s "
        f"(this is process {process_id} of {num_processes}); JAX is about to stop this process. "
        f"Check that all {num_processes} processes were started, with the same process count "
        f"and coordinator address, and distinct process ids.",
        file=sys.stderr, flush=True,
    )


def _check_arguments(coordinator_address, num_processes, process_id, timeout, cluster) -> None:
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}.")
    if cluster is None:
        missing = [name for name, value in (
            ("coordinator address (KERAS_DISTRIBUTION_JOB_ADDRESSES)", coordinator_address),
            ("number of processes (KERAS_DISTRIBUTION_NUM_PROCESSES)", num_processes),
            ("process id (KERAS_DISTRIBUTION_PROCESS_ID)", process_id),
        ) if value is None]
        if missing:
            raise ValueError(
                f"Multi-process setup is incomplete: no {', no '.join(missing)}, and no cluster "
                f"environment (SLURM, Open MPI, Kubernetes, TPU) was detected. Set all three, "
                f"or none for a single process; `python -m kdist.launch` sets them locally."
            )
    if coordinator_address is not None and not _ADDRESS.match(coordinator_address):
        raise ValueError(
            f"Coordinator address {coordinator_address!r} is not of the form HOST:PORT "
            f"(e.g. '10.0.0.1:1234' or '127.0.0.1:5678')."
        )
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes must be at least 1; got {num_processes}.")
    if process_id is not None and num_processes is not None and not (
        0 <= process_id < num_processes
    ):
        raise ValueError(
            f"process_id={process_id} is outside 0..{num_processes - 1} for "
            f"num_processes={num_processes}. Give each process a distinct id below the count."
        )


def _check_process_count(requested: int | None, timeout: int) -> None:
    """Every process must agree on the process count; a mismatch would hang a collective.

    JAX takes the count from process 0; a process started with another count is told here,
    and so is process 0 (each process publishes its own view in the coordinator's store).
    """
    import jax

    actual = jax.process_count()
    me = jax.process_index()
    client = _keras_compat.distributed_client()
    # Publish first, so that the others learn of a mismatch here too.
    client.key_value_set(f"kdist/num_processes/{me}", str(requested or actual))
    if requested is not None and requested != actual:
        raise ValueError(
            f"Inconsistent process counts: process {me} was started with num_processes="
            f"{requested}, but the coordinator runs a job of {actual} processes. Start every "
            f"process with the same count (KERAS_DISTRIBUTION_NUM_PROCESSES)."
        )
    views = {}
    for other in range(actual):
        views[other] = int(client.blocking_key_value_get(
            f"kdist/num_processes/{other}", int(timeout) * 1000
        ))
    if len(set(views.values())) > 1:
        raise ValueError(
            f"Inconsistent process counts: the processes were started with num_processes "
            f"{views} (process: count). Start every process with the same count."
        )


def _sync_keras_seed() -> None:
    """The same Keras seed in every process, as ``keras.distribution.initialize`` does."""
    _keras_compat.sync_keras_seed()

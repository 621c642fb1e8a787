"""Host (CPU) devices for development and tests: an explicit call, never an import effect.

On a machine without accelerators XLA can present one CPU as N devices, so every sharding
path runs on a laptop or in CI. That must be configured before JAX starts its backends;
``import kdist`` changes nothing (only the Keras backend is set to JAX when the user chose
none) — a script, a recipe flag (``--host-devices``), the Makefile or ``tests/conftest.py``
calls :func:`force_host_devices`.
"""

from __future__ import annotations

import os
import re

from kdist import _keras_compat

_COUNT = re.compile(r"--xla_force_host_platform_device_count=\d+")


def force_host_devices(count: int) -> None:
    """Presents the CPU as ``count`` devices, with XLA:CPU settings that keep collectives
    between them from stalling. Must run before JAX's first device use.

    * ``--xla_force_host_platform_device_count=count``.
    * One Eigen thread per device (``--xla_cpu_multi_thread_eigen=false``). Seen here
      (8 forced devices, 2 cores): a train step aborted in an all-gather rendezvous
      ("Expected 8 threads ... only 3 arrived") while device threads waited on a saturated
      shared Eigen pool; step time under fsdp=8 was unchanged (1.69 vs 1.72 s).
    * ``NPROC`` = 4 threads per device, unless set: XLA:CPU runs each device's collective
      on its intra-op pool (``max(cores, devices)`` threads), where the thread waits for
      every participant; when collectives of different groups are ready at once, waiting
      participants can hold every thread ("only 6 arrived" after 40 s, GPT and BERT alike).

    Example:
        >>> import kdist
        >>> kdist.force_host_devices(8)   # before anything touches jax.devices()
    """
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"force_host_devices(count): count must be a positive int (the "
                         f"number of CPU devices to present); got {count!r}.")
    wanted = host_device_environment(count, os.environ)
    if _keras_compat.jax_backends_started():
        import jax

        if jax.local_device_count() == count or os.environ.get("XLA_FLAGS") == wanted["XLA_FLAGS"]:
            return
        raise RuntimeError(
            f"force_host_devices({count}) must run before JAX starts its devices, but JAX "
            f"already runs with {jax.local_device_count()} local device(s). Call it at the top "
            f"of the script, before anything uses jax.devices() or builds a model.")
    os.environ.update(wanted)


def host_device_environment(count: int, env) -> dict[str, str]:
    """The variables :func:`force_host_devices` sets, computed from ``env`` (for a child
    process's environment, as ``kdist.launch`` builds it).

    Example:
        >>> host_device_environment(4, {})["XLA_FLAGS"]
        '--xla_force_host_platform_device_count=4 --xla_cpu_multi_thread_eigen=false'
    """
    flags = _COUNT.sub("", env.get("XLA_FLAGS", "")).strip()
    flags = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    out = {}
    if count > 1:
        if "xla_cpu_multi_thread_eigen" not in flags:
            flags += " --xla_cpu_multi_thread_eigen=false"
        out["NPROC"] = env.get("NPROC") or str(4 * count)
    out["XLA_FLAGS"] = flags
    return out

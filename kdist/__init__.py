"""kdist: sharded Transformer training with Keras 3 on JAX.

A user writes an ordinary Keras script; kdist supplies the distribution, the models, the
data and the optimizer recipe:

    import keras, kdist
    keras.distribution.set_distribution(kdist.distribution("fsdp=8"))
    data = kdist.data.lm_dataset("python-stdlib", sequence_length=256, global_batch_size=32)
    model = kdist.models.GPTCausalLM.from_preset("gpt-nano", vocabulary_size=data.vocabulary_size)
    model.compile(optimizer=kdist.optim.adamw(3e-4, warmup_steps=100, decay_steps=2000))
    model.fit(data.train, validation_data=data.validation, epochs=1, steps_per_epoch=2000)
"""

import os
import re

os.environ.setdefault("KERAS_BACKEND", "jax")


def _single_threaded_eigen_for_forced_host_devices() -> None:
    """With several forced host devices, keep XLA:CPU's Eigen matmuls on each device's thread.

    Seen here (8 forced devices, 2 cores): a train step aborted in an all-gather rendezvous
    ("Expected 8 threads ... only 3 arrived") — device threads were waiting on a saturated
    shared Eigen pool. One Eigen thread per device avoids the shared pool; step time under
    fsdp=8 was unchanged (1.69 vs 1.72 s). Only applies if jax is not imported yet.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    forced = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
    if forced and int(forced.group(1)) > 1 and "xla_cpu_multi_thread_eigen" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_multi_thread_eigen=false".strip()


_single_threaded_eigen_for_forced_host_devices()


def _enough_pool_threads_for_host_collectives() -> None:
    """Sizes XLA:CPU's intra-op pool for collectives between forced host devices.

    XLA:CPU's thunk executor runs a device's collective on that pool, and the thread waits
    there until every participant arrives. The pool has max(cores, devices) threads, 8 here,
    so when collectives of different groups are ready at once (an all-gather over fsdp
    and an all-reduce over model), the waiting participants can hold every thread and the
    rest never start: seen here on 2 loaded cores as "Expected 8 threads to join the
    rendezvous, but only 6 arrived" after 40 s, in GPT and BERT runs alike. The pool
    reads its size from NPROC; 4 threads per device leave room for 4 concurrent
    collectives. Only applies if jax is not imported yet and NPROC is not set.
    """
    forced = re.search(r"--xla_force_host_platform_device_count=(\d+)",
                       os.environ.get("XLA_FLAGS", ""))
    if forced and int(forced.group(1)) > 1:
        os.environ.setdefault("NPROC", str(4 * int(forced.group(1))))


_enough_pool_threads_for_host_collectives()

# ruff: noqa: E402
import keras

if keras.backend.backend() != "jax":
    raise ImportError(
        f"kdist needs Keras on the JAX backend, but Keras was loaded with the "
        f"'{keras.backend.backend()}' backend. Set KERAS_BACKEND=jax in the environment, or "
        f"import kdist before keras."
    )

from kdist import callbacks, data, flops, models, optim
from kdist.distribution import KdistDistribution, distribution, parse_mesh
from kdist.multihost import initialize

# isort: split
from kdist import auto_sharding, hlo, plan  # planning: `kdist plan`, any-model sharding

__version__ = "0.1.0"

__all__ = [
    "KdistDistribution", "callbacks", "data", "distribution", "flops", "models", "optim",
    "parse_mesh",
    "initialize",
    "auto_sharding", "hlo", "plan",
]

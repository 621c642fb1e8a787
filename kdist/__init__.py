"""kdist: sharded Transformer training with Keras 3 on JAX.

A user writes an ordinary Keras script; kdist supplies the distribution, the models, the
data and the optimizer recipe:

    import keras, kdist
    keras.distribution.set_distribution(kdist.distribution("fsdp=8"))
    data = kdist.data.lm_dataset("python-stdlib", sequence_length=256, global_batch_size=32)
    model = kdist.models.GPTCausalLM.from_preset("gpt-nano", vocabulary_size=data.vocabulary_size)
    model.compile(optimizer=kdist.optim.adamw(3e-4, warmup_steps=100, decay_steps=2000))
    model.fit(data.train, validation_data=data.validation, epochs=1, steps_per_epoch=2000)

The package's map:

=============================  ==============================================================
``parallel``                   devices and sharding; the training step's transforms
``models``                     model families (GPT, BERT) as Keras layers and tasks
``data``                       corpora, tokenizers, deterministic batches
``precision``                  ``kdist.precision("int8")``: quantized (int8, fp8) matmul training
``optim``                      AdamW, schedules, weight-decay mask, clipping, accumulation
``callbacks``                  throughput, MFU, memory, run logs (Keras callbacks)
``checkpointing``              checkpoints: format, integrity, exact resume, the callback
``groups``                     DiLoCo replica groups: in one program, or as jobs that survive
                               each other
``planning``                   ``kdist plan``: memory, FLOPs and traffic before running
``accelerators``, ``kernels``  the device table and its defaults; Pallas kernels
``hf``                         Hugging Face checkpoints in and out (short names)
``compiled_step``              the train step compiled ahead of its first call; its memory
``flops``, ``hlo``             FLOPs-per-token arithmetic; compiled programs' collectives
``multihost``, ``launch``      ``kdist.initialize()``; the local multi-process launcher
``local_processes``            a JAX process started here (the launcher's, the groups')
``durable``                    fsync, checksums, the writability probe (checkpoints, stores)
``orbax_writer``               the orbax handler arrays are written with (checkpoints, stores)
``cli``, ``__main__``          the ``kdist`` command (``python -m kdist``)
``run_report``, ``measure``    ``kdist report``; real-run memory for the plan's checks
``run_comparison``             ``kdist report RUN_A RUN_B``: several runs on one figure
``_optional``, ``noise``       extras imported at first use; native start-up lines filtered
``_keras_compat``              every use of private Keras/JAX API, in one place
=============================  ==============================================================
"""

import os

# The one environment default kdist sets: Keras' backend, when the user chose none (kdist
# needs JAX). Nothing else in the environment changes at import; forcing host devices and
# XLA:CPU flags is an explicit call, kdist.force_host_devices(n).
if "KERAS_BACKEND" not in os.environ:
    os.environ["KERAS_BACKEND"] = "jax"

# ruff: noqa: E402
# Nothing here imports TensorFlow, keras-hub or TFDS: the text pipeline and TFDS import them
# when first used (kdist/_optional.py), inside the native-noise filter (kdist/noise.py),
# which also wraps these imports in case a native library they load writes start-up noise.
from kdist.noise import native_noise_filtered

with native_noise_filtered():
    import keras

    if keras.backend.backend() != "jax":
        raise ImportError(
            f"kdist needs Keras on the JAX backend, but Keras was loaded with the "
            f"'{keras.backend.backend()}' backend. Import kdist before keras (it selects "
            f"the JAX backend when none was chosen), or set KERAS_BACKEND=jax in the "
            f"environment."
        )
    # Keras imports TensorFlow where it is installed in every get_config and seed, to
    # recognise TensorFlow's objects: only once something else has imported it.
    from kdist._keras_compat import tensorflow_only_when_loaded

    tensorflow_only_when_loaded()

    from kdist import (
        callbacks,
        data,
        flops,
        groups,  # replica groups as separate jobs (fault-tolerant DiLoCo)
        hf,  # Hugging Face checkpoints in and out
        models,
        optim,
        parallel,
        precision,  # matmul_precision: int8 / fp8 matmul training
    )
    from kdist.multihost import initialize
    from kdist.parallel import KdistDistribution, distribution, force_host_devices, parse_mesh

    # isort: split
    from kdist import hlo, planning  # planning: `kdist plan`
    from kdist import planning as plan  # its former name: kdist.plan.plan(...) still works

__version__ = "0.1.0"

__all__ = [
    "KdistDistribution", "callbacks", "data", "distribution", "flops", "force_host_devices",
    "groups", "hf", "models", "optim", "parallel", "parse_mesh", "precision",
    "initialize",
    "hlo", "plan", "planning",
]

"""Keras callbacks for kdist runs (one callback per file) and what they read.

================  ===========================================================================
``throughput``    ``Throughput``: tokens/s, MFU, step time, memory, logged without a sync
``step_clock``    step, compile, evaluation and stall timing on the host clock
``step_loss``     each step's own loss from Keras' running mean
``mfu``           model FLOPs utilisation (never above 1; shown only when reliable)
``peak``          the device's peak FLOP/s: the accelerator table, an override, measured
``step_memory``   the compiled train step's peak beside the live buffers
``run_log``       JSONL and TensorBoard records of a run
``event_file``    TensorBoard event files written without TensorFlow
``stragglers``    per-process input wait; the slow process named
``fit_devices``   the devices a ``fit`` runs on, as the callbacks count them
``expert_load``   ``ExpertLoad``: a Mixture of Experts' min/max expert share and dropped count
``checkpoint``    ``Checkpoint`` (re-exported from :mod:`kdist.checkpointing`)
================  ==========================================================================="""

from kdist.callbacks.checkpoint import Checkpoint, CheckpointError
from kdist.callbacks.expert_load import ExpertLoad
from kdist.callbacks.throughput import Throughput, parse_profile_steps

__all__ = ["Checkpoint", "CheckpointError", "ExpertLoad", "Throughput", "parse_profile_steps"]

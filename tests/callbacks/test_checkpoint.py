"""Checkpoint: exact resume, damaged and partial steps, disk full, resharding, signals."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest

import kdist
from kdist.callbacks import Checkpoint, CheckpointError
from kdist.callbacks.checkpoint import committed_steps, read_metadata, verify_step
from kdist.data.lm import LMBatches
from tests.helpers import parity_optimizer, tiny_gpt, weights

TOKENS = np.random.default_rng(0).integers(0, 256, size=4000).astype(np.int32)
WORKER = Path(__file__).with_name("checkpoint_worker.py")


class Record(keras.callbacks.Callback):
    """Per-step logged losses (Keras' running epoch means); optionally stops at a step."""

    def __init__(self, stop_at=None):
        super().__init__()
        self.losses, self.stop_at, self.step = [], stop_at, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs = getattr(self, "epochs", []) + [epoch]

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(logs["loss"])
        if self.stop_at is not None and len(self.losses) == self.stop_at:
            self._model.stop_training = True


def run(directory, epochs, stop_at=None, mesh=None, steps_per_epoch=4, **ckpt_args):
    """A fresh tiny GPT (dropout on) trained by fit on LMBatches with a Checkpoint."""
    keras.utils.clear_session()
    model = tiny_gpt(mesh, dropout=0.1)
    model.compile(optimizer=parity_optimizer())
    data = LMBatches(TOKENS, sequence_length=16, global_batch_size=8, seed=3)
    record = Record(stop_at)
    ckpt = Checkpoint(directory, data=data, verbose=False, handle_signals=False,
                      **{"save_every_steps": 3, **ckpt_args})
    model.fit(data, epochs=epochs, steps_per_epoch=steps_per_epoch, shuffle=False, verbose=0,
              callbacks=[record, ckpt])
    return model, record, ckpt, data


def test_resume_mid_epoch_is_bit_exact(tmp_path):
    full_model, full, _, _ = run(tmp_path / "full", epochs=3)
    # Stop at step 6 (epoch 1, after 2 of its 4 steps); the final save commits step 6.
    _, first, ckpt, _ = run(tmp_path / "split", epochs=3, stop_at=6)
    assert committed_steps(tmp_path / "split") == [3, 6]
    assert read_metadata(tmp_path / "split" / "6")["data_step"] == 6
    model, second, ckpt, data = run(tmp_path / "split", epochs=3)
    assert ckpt.restored_step == 6 and data.start_step == 6  # data resumes at batch 6
    assert second.epochs == [1, 2]  # fit started in the interrupted epoch
    assert len(first.losses) + len(second.losses) == 12  # no batch repeated or skipped
    assert first.losses + second.losses == full.losses  # bit-exact, every step
    resumed, reference = weights(model), weights(full_model)
    assert all(np.array_equal(resumed[k], reference[k]) for k in reference)
    assert committed_steps(tmp_path / "split") == [6, 9, 12]  # keep=3

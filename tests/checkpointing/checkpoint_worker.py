"""A tiny training run in its own process, for the kill -9 and SIGTERM tests.

    python checkpoint_worker.py DIR hang-in-save   # saves every 2 steps; hangs inside step 4's save
    python checkpoint_worker.py DIR train          # 8 steps, resuming from DIR
    python checkpoint_worker.py DIR until-signal   # endless; DIR/../running appears at step 3
    python checkpoint_worker.py DIR until-signal-validation  # the same, with validation data
    python checkpoint_worker.py DIR faults         # 40 steps, a save every step, all kept;
                                                   # prints "batch k" and "loss k <repr>"
    python checkpoint_worker.py DIR reference      # the same 40 steps, no checkpoint
    python checkpoint_worker.py DIR unwritable     # the directory turns into a file at step 2

The tests start it with :func:`start_worker`: one host device (no forced device count) and
the suite's compile-time flags (tests/xla_flags.py), which compile its step cold in ~0.7 s
rather than 2-4 s; every run a test compares (a fault trial's reference and its reruns)
has the same flags, so their losses match bit for bit.
"""

import subprocess
import sys
import time
from pathlib import Path

import kdist  # noqa: F401 (selects the JAX backend)

# isort: split
import keras
import numpy as np

from kdist.callbacks import Checkpoint
from kdist.data.lm import LMBatches
from tests.helpers import ROOT, child_environment, parity_optimizer, tiny_gpt
from tests.xla_flags import FAST_COMPILE


def start_worker(directory, mode) -> subprocess.Popen:
    """This script in a child process, its output piped (see the module's docstring)."""
    return subprocess.Popen([sys.executable, __file__, str(directory), mode], cwd=ROOT,
                            env=child_environment(XLA_FLAGS=FAST_COMPILE),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


class SayRunning(keras.callbacks.Callback):
    """Prints "running" once ``at`` batches have ended (the test waits for that line)."""

    def __init__(self, at):
        super().__init__()
        self.at, self.seen = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at:
            print("running", flush=True)


class Report(keras.callbacks.Callback):
    """Prints every step's number and logged loss (before the checkpoint callback runs)."""

    def __init__(self, base):
        super().__init__()
        self.step = base

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        print(f"batch {self.step}\nloss {self.step} {logs['loss']!r}", flush=True)


class SayEvaluating(keras.callbacks.Callback):
    def on_test_batch_begin(self, batch, logs=None):
        print("evaluating", flush=True)


class BreakDirectory(keras.callbacks.Callback):
    """Replaces the checkpoint directory by a file after step 1: the next save must fail."""

    def __init__(self, directory):
        super().__init__()
        self.directory = directory

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            import shutil

            shutil.rmtree(self.directory)
            self.directory.write_text("not a directory")
            print("broken", flush=True)


def main(directory, mode):
    directory = Path(directory)
    model = tiny_gpt(None)
    model.compile(optimizer=parity_optimizer())
    data = LMBatches(np.arange(4000) % 256, sequence_length=16, global_batch_size=8, seed=3)
    if mode == "hang-in-save":
        write = Checkpoint._write_metadata

        def hang_at_step_4(self):
            if self._pending and self._pending["step"] == 4:
                print("in_save", flush=True)
                time.sleep(600)  # the test kills the process here: arrays written, no commit
            write(self)

        Checkpoint._write_metadata = hang_at_step_4
    if mode == "reference":  # the faults run's 40 steps without a checkpoint: its losses
        model.fit(data, epochs=1, steps_per_epoch=40, verbose=0, callbacks=[Report(0)])
        print("DONE", flush=True)
        return
    if mode == "faults":
        ckpt = Checkpoint(directory, save_every_steps=1, keep=1000, data=data)
        start = ckpt.restore(model)
        print(f"resumed {start}", flush=True)
        model.fit(data, epochs=1, steps_per_epoch=40, verbose=0,
                  callbacks=[Report(start), ckpt])
        print(f"DONE restored={ckpt.restored_step} step={ckpt.step}", flush=True)
        return
    if mode == "unwritable":
        ckpt = Checkpoint(directory, save_every_steps=2, data=data)
        model.fit(data, epochs=1, steps_per_epoch=8, verbose=0,
                  callbacks=[BreakDirectory(directory), ckpt])
        return
    endless = mode.startswith("until-signal")
    ckpt = Checkpoint(directory, save_every_steps=None if endless else 2, data=data)
    callbacks = [SayRunning(3)] if endless else []
    validation = None
    if mode == "until-signal-validation":
        validation = LMBatches(np.arange(4000) % 256, sequence_length=16, global_batch_size=8,
                               seed=4)
        callbacks.append(SayEvaluating())
    model.fit(data, epochs=1, steps_per_epoch=100_000 if endless else 8, verbose=0,
              validation_data=validation, validation_steps=2, callbacks=callbacks + [ckpt])
    print(f"DONE restored={ckpt.restored_step} step={ckpt.step}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

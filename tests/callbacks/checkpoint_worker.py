"""A tiny training run in its own process, for the kill -9 and SIGTERM tests.

    python checkpoint_worker.py DIR hang-in-save   # saves every 2 steps; hangs inside step 4's save
    python checkpoint_worker.py DIR train          # 8 steps, resuming from DIR
    python checkpoint_worker.py DIR until-signal   # endless; DIR/../running appears at step 3
"""

import sys
import time
from pathlib import Path

import kdist  # noqa: F401 (selects the JAX backend)

# isort: split
import keras
import numpy as np

from kdist.callbacks import Checkpoint
from kdist.data.lm import LMBatches
from tests.helpers import parity_optimizer, tiny_gpt


class SayRunning(keras.callbacks.Callback):
    """Prints "running" once ``at`` batches have ended (the test waits for that line)."""

    def __init__(self, at):
        super().__init__()
        self.at, self.seen = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at:
            print("running", flush=True)


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
    endless = mode == "until-signal"
    ckpt = Checkpoint(directory, save_every_steps=None if endless else 2, data=data)
    callbacks = [SayRunning(3)] if endless else []
    model.fit(data, epochs=1, steps_per_epoch=100_000 if endless else 8, verbose=0,
              callbacks=callbacks + [ckpt])
    print(f"DONE restored={ckpt.restored_step} step={ckpt.step}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Checkpoints and ``.keras`` files written by an older kdist (commit 7f3d1d7, before
checksums) still load, with identical weights.

``tests/fixtures/ckpt-7f3d1d7`` (a ``Checkpoint`` directory, step 2), ``gpt-7f3d1d7.keras``
and ``gpt-7f3d1d7-weights.npz`` (every weight by path) were written by that commit: a GPT
with vocabulary 64, 1 layer, 2 heads, width 32, trained 2 steps (the script is in the
docstring of :func:`test_old_checkpoint_restores`).
"""

import shutil

import keras
import numpy as np

import kdist
from kdist.checkpointing import Checkpoint, inspect_directory, read_metadata, verify_step
from tests.helpers import FIXTURES

CONFIG = dict(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=32,
              intermediate_dim=64, max_sequence_length=16)


def expected():
    with np.load(FIXTURES / "gpt-7f3d1d7-weights.npz") as f:
        return dict(f)


def test_old_checkpoint_restores(tmp_path):
    """Written at 7f3d1d7 by (``PYTHONPATH`` = a worktree of that commit)::

        model = GPTCausalLM(GPTBackbone(**CONFIG)); model.compile(optimizer=kdist.optim.adamw(
            learning_rate=1e-2, warmup_steps=1, decay_steps=10))
        data = LMBatches(np.arange(2000) % 64, sequence_length=16, global_batch_size=4, seed=3)
        model.fit(data, epochs=1, steps_per_epoch=2, callbacks=[Checkpoint(DIR,
                  save_every_steps=2, data=data, keep=1)])
        model.save("gpt-7f3d1d7.keras")
    """
    directory = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "ckpt-7f3d1d7", directory)
    assert "checksums" not in read_metadata(directory / "2")  # sizes only
    assert verify_step(directory / "2") == []
    text, ok = inspect_directory(directory)
    assert ok and "sizes only" in text, text
    model = kdist.models.GPTCausalLM(kdist.models.GPTBackbone(**CONFIG))
    model.compile(optimizer=kdist.optim.adamw(learning_rate=1e-2, warmup_steps=1,
                                              decay_steps=10))
    assert Checkpoint(directory, data="restart", verbose=False).restore(model) == 2
    assert int(model.optimizer.iterations.numpy()) == 2
    want = expected()
    assert sorted(want) == sorted(w.path for w in model.weights)
    for w in model.weights:
        np.testing.assert_array_equal(np.asarray(w.value), want[w.path], err_msg=w.path)


def test_old_keras_file_loads():
    model = keras.saving.load_model(FIXTURES / "gpt-7f3d1d7.keras")
    assert type(model).__name__ == "GPTCausalLM"
    want = expected()
    assert sorted(want) == sorted(w.path for w in model.weights)
    for w in model.weights:
        np.testing.assert_array_equal(np.asarray(w.value), want[w.path], err_msg=w.path)

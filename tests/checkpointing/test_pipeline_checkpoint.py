"""Checkpoints across layer layouts: saved under a pipeline (stacked blocks) and resumed
unstacked under fsdp=8 and on one device, and an old unstacked checkpoint into a stacked
model — every value bit-exact."""

import shutil

import keras
import numpy as np
import pytest

import kdist
from kdist.checkpointing import Checkpoint, state_variables
from kdist.data.lm import LMBatches
from kdist.models import GPTBackbone, GPTCausalLM
from kdist.models.stacking import match_layer_layout, stack_layer_weights
from tests.helpers import FIXTURES, TINY_GPT, parity_optimizer

CONFIG = dict(TINY_GPT, num_layers=4)


def _model(mesh, **overrides):
    keras.utils.clear_session()
    keras.distribution.set_distribution(kdist.distribution(mesh) if mesh else None)
    keras.utils.set_random_seed(0)
    model = GPTCausalLM(GPTBackbone(**{**CONFIG, **overrides}))
    model.compile(optimizer=parity_optimizer())
    return model


def _data():
    return LMBatches(np.arange(5000) % 256, sequence_length=16, global_batch_size=16, seed=3)


def _state(model) -> dict:
    return {k: np.asarray(v.value) for k, v in state_variables(model).items()}


@pytest.fixture(scope="module")
def pipeline_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pipeline") / "ckpt"
    model = _model("stage=4,fsdp=2")
    assert model.backbone.scan_layers  # stacked by default under a stage axis
    data = _data()
    model.fit(data, epochs=1, steps_per_epoch=2, verbose=0,
              callbacks=[Checkpoint(directory, save_every_steps=2, data=data, verbose=False)])
    saved = _state(model)
    keras.utils.clear_session()
    return directory, saved


@pytest.mark.xdist_group("pipeline_checkpoint")  # the module fixture once, not per worker
@pytest.mark.parametrize("mesh", ["fsdp=8", None])
def test_pipeline_checkpoint_resumes_unstacked_bit_exact(mesh, pipeline_checkpoint):
    directory, saved = pipeline_checkpoint
    model = _model(mesh)
    assert not model.backbone.scan_layers
    data = _data()
    assert Checkpoint(directory, data=data, verbose=False).restore(model) == 2
    restored = _state(model)
    want = match_layer_layout(saved, {k: v.shape for k, v in restored.items()})
    assert sorted(want) == sorted(restored)
    for key, value in restored.items():
        np.testing.assert_array_equal(value, want[key], err_msg=key)
    assert {k for k in restored if k.startswith("optimizer.") and "block_3" in k}  # moments
    if mesh is None:  # and it trains on from there
        history = model.fit(data, epochs=1, steps_per_epoch=1, verbose=0)
        assert np.isfinite(history.history["loss"][-1])


def test_unstacked_checkpoint_restores_into_a_stacked_model(tmp_path):
    """The old (commit 7f3d1d7) unstacked checkpoint of test_checkpoint_compat.py, into a
    model with scan_layers=True: the same values, stacked."""
    directory = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "ckpt-7f3d1d7", directory)
    keras.distribution.set_distribution(None)
    model = GPTCausalLM(GPTBackbone(vocabulary_size=64, num_layers=1, num_heads=2,
                                    hidden_dim=32, intermediate_dim=64,
                                    max_sequence_length=16, scan_layers=True))
    model.compile(optimizer=kdist.optim.adamw(learning_rate=1e-2, warmup_steps=1,
                                              decay_steps=10))
    assert Checkpoint(directory, data="restart", verbose=False).restore(model) == 2
    with np.load(FIXTURES / "gpt-7f3d1d7-weights.npz") as f:
        want = stack_layer_weights(dict(f))
    assert sorted(want) == sorted(w.path for w in model.weights)
    for w in model.weights:
        np.testing.assert_array_equal(np.asarray(w.value), want[w.path], err_msg=w.path)

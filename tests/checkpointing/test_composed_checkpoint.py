"""A checkpoint of composed axes — DiLoCo groups, each a 2-stage pipeline over a 2-device
ring (``replica=2,stage=2,seq=2``) — resumes mid-round bit-exactly there, and its weights
load on ``fsdp=8`` and on one device (blocks unstacked)."""

import keras
import numpy as np
import pytest

import kdist
from kdist.checkpointing import Checkpoint
from kdist.data.lm import LMBatches
from kdist.models import GPTBackbone, GPTCausalLM
from kdist.models.stacking import match_layer_layout
from tests.helpers import TINY_GPT, fit_with_checkpoint, parity_optimizer, weights

MESH = "replica=2,stage=2,seq=2"
# Every test reads the module's fixture (three fits, ~35 s): on one xdist worker, it runs once.
pytestmark = pytest.mark.xdist_group("composed_checkpoint")
CONFIG = dict(TINY_GPT, num_layers=4)  # no dropout: see combinations (seq x replica)
TOKENS = np.random.default_rng(0).integers(0, 256, size=4000).astype(np.int32)


def _model(mesh, **options):
    keras.utils.clear_session()
    keras.distribution.set_distribution(kdist.distribution(mesh, **options) if mesh else None)
    keras.utils.set_random_seed(1)
    model = GPTCausalLM(GPTBackbone(**CONFIG))
    model.compile(optimizer=parity_optimizer())
    return model


def _fit(directory, stop_at=None):
    model = _model(MESH, sync_every=3, context_parallel="ring")
    data = LMBatches(TOKENS, sequence_length=16, global_batch_size=8, seed=3)
    return model, fit_with_checkpoint(model, data, directory, steps_per_epoch=3,
                                      stop_at=stop_at)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("composed")
    full_model, full = _fit(root / "full")
    _, first = _fit(root / "split", stop_at=4)  # step 4: one inner step into round 2
    model, second = _fit(root / "split")
    return root / "split", full_model, full, model, first + second


@pytest.mark.slow  # three fits of two programs each on replica=2,stage=2,seq=2
def test_resumes_mid_round_bit_exactly(resumed):
    _, full_model, full, model, split = resumed
    assert model.backbone.scan_layers  # the pipeline's stacked blocks
    assert split == full  # every step's loss: groups' weights, inner and outer state
    got, want = weights(model), weights(full_model)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["fsdp=8", None])
def test_its_weights_load_on_another_mesh(mesh, resumed, tmp_path):
    directory, _, _, saved_model, _ = resumed
    saved = weights(saved_model)  # theta: the outer weights of the last sync
    model = _model(mesh)
    assert not model.backbone.scan_layers
    Checkpoint(tmp_path / "new", init_from=directory, verbose=False).restore(model)
    got = weights(model)
    want = match_layer_layout(saved, {k: v.shape for k, v in got.items()})
    assert sorted(want) == sorted(got)
    for k in got:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)

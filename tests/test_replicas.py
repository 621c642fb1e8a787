"""DiLoCo over the replica axis (kdist.parallel.replicas): the exact special cases, what
crosses replica groups, and mid-round resume."""

import functools

import jax
import keras
import numpy as np
import pytest

import kdist
from kdist import _keras_compat, hlo
from kdist.callbacks import Checkpoint
from kdist.data.lm import LMBatches
from kdist.models import GPTBackbone, GPTCausalLM
from kdist.parallel import replicas
from tests.helpers import TINY_GPT, parity_optimizer, token_batches, train, weights

PLAIN = dict(outer_learning_rate=1.0, outer_momentum=0.0)  # the sync is a plain average


def _model(mesh, config=TINY_GPT, **dist_options):
    keras.distribution.set_distribution(kdist.distribution(mesh, **dist_options))
    keras.utils.set_random_seed(1)
    return GPTCausalLM(GPTBackbone(**config))


def test_inner_sgd_synced_every_step_is_data_parallel_sgd():
    # H = 1, outer lr 1, no momentum: theta - mean_r(theta - (theta - lr g_r)) is SGD on the
    # mean gradient of both groups' rows: synchronous data parallelism over the same
    # devices. With dropout: each group draws its rows of the global mask.
    batches, config = token_batches(4), {**TINY_GPT, "dropout": 0.1}
    sgd = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    reference = train(_model("data=2,fsdp=4", config), batches, sgd())
    diloco = train(_model("replica=2,fsdp=4", config, sync_every=1, **PLAIN), batches, sgd())
    np.testing.assert_allclose(diloco, reference, rtol=2e-6)


def test_one_group_with_a_plain_average_is_plain_training():
    batches = token_batches(3)
    reference = train(_model("fsdp=8"), batches)
    model = _model("fsdp=8", sync_every=2, **PLAIN)
    np.testing.assert_allclose(train(model, batches), reference, rtol=2e-6)
    assert type(model.optimizer).__name__ == "DiLoCo" and int(model.optimizer.iterations) == 3


@pytest.fixture(scope="module")
def diloco_run():
    """replica=2,data=2,model=2 (tensor parallel inside each group), AdamW, H = 3."""
    keras.utils.clear_session()
    model = _model("replica=2,data=2,model=2", sync_every=3)
    losses = train(model, token_batches(4))
    return model, losses, keras.distribution.distribution()


def test_building_the_optimizer_again_adds_nothing(diloco_run):
    # Users build optimizers before restoring state; Keras' own return when built.
    optimizer = diloco_run[0].optimizer
    before = [id(v) for v in optimizer.variables]
    optimizer.build(diloco_run[0].trainable_variables)
    assert [id(v) for v in optimizer.variables] == before


def test_groups_drift_between_syncs_and_meet_at_them(diloco_run):
    model, losses, _ = diloco_run
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    optimizer, theta = model.optimizer, model.trainable_variables
    params = [optimizer.variables[i].value for i in optimizer.groups.params]
    # Step 4 is one inner step after the sync at step 3: the groups hold different weights,
    # and theta (the model's weights) is the sync's.
    assert any(not np.array_equal(p[0], p[1]) for p in params)
    assert all(p.shape == (2, *t.shape) for p, t in zip(params, theta))
    step = [v for v in optimizer.variables if v.path.endswith("replica_iteration")][0]
    np.testing.assert_array_equal(step.value, [4, 4])  # each group's own inner AdamW count


def _cross_group_bytes(model, sync, groups=2):
    x, y = token_batches(1)[0]
    state = _keras_compat.jax_state(model)
    step = jax.jit(functools.partial(replicas.train_step, model, sync=sync))
    text = step.lower(state, (x, y)).compile().as_text()
    block = jax.device_count() // groups
    return sum(c.bytes for c in hlo.parse_collectives(text, jax.device_count())
               if c.crosses(block))


def test_only_the_sync_step_communicates_across_groups(diloco_run):
    model, _, dist = diloco_run
    keras.distribution.set_distribution(dist)
    inner, sync = _cross_group_bytes(model, False), _cross_group_bytes(model, True)
    assert inner <= 8  # the mean of the logged loss; nothing of the weights
    # Per device: its shard (over model) of every parameter's change, and the loss.
    shard = sum(np.prod(w.value.sharding.shard_shape(w.shape)) * 4
                for w in model.trainable_variables)
    assert shard < sum(w.value.size * 4 for w in model.trainable_variables)
    assert shard <= sync <= shard + 8


@pytest.mark.slow  # ~70 s on 2 shared cores: three fits, each compiling two programs
def test_mid_round_resume_is_bit_exact(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 256, size=4000).astype(np.int32)

    def run(directory, stop_at=None):
        keras.utils.clear_session()
        model = _model("replica=2,fsdp=4", {**TINY_GPT, "dropout": 0.1}, sync_every=3)
        model.compile(optimizer=parity_optimizer())
        data = LMBatches(tokens, sequence_length=16, global_batch_size=8, seed=3)
        losses = []

        class Record(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                losses.append(logs["loss"])
                if len(losses) == stop_at:
                    _keras_compat.callback_model(self).stop_training = True

        ckpt = Checkpoint(directory, data=data, verbose=False, handle_signals=False,
                          save_every_steps=4)
        model.fit(data, epochs=2, steps_per_epoch=4, shuffle=False, verbose=0,
                  callbacks=[Record(), ckpt])
        return model, losses

    full_model, full = run(tmp_path / "full")
    _, first = run(tmp_path / "split", stop_at=4)  # step 4: one inner step into round 2
    model, second = run(tmp_path / "split")
    assert first + second == full  # bit-exact: groups' weights, inner and outer state
    resumed, reference = weights(model), weights(full_model)
    assert all(np.array_equal(resumed[k], reference[k]) for k in reference)


def test_replica_settings_are_checked():
    with pytest.raises(ValueError, match="need sync_every=H"):
        kdist.distribution("replica=2,fsdp=4")
    with pytest.raises(ValueError, match="sync_every must be a positive integer"):
        kdist.distribution("replica=2,fsdp=4", sync_every=0)
    with pytest.raises(ValueError, match="outer_momentum must be a number in"):
        kdist.distribution("replica=2,fsdp=4", sync_every=5, outer_momentum=1.0)
    with pytest.raises(ValueError, match="outer_learning_rate must be a finite number"):
        kdist.distribution("replica=2,fsdp=4", sync_every=5, outer_learning_rate=float("nan"))
    with pytest.raises(ValueError, match="sync_every=5 .DiLoCo. is not built for a 'stage'"):
        kdist.distribution("replica=2,stage=2,fsdp=2", sync_every=5)
    with pytest.raises(ValueError, match="gradient_reduction='int8' is not built for a 'seq'"):
        kdist.distribution("seq=2,fsdp=4", gradient_reduction="int8")
    with pytest.raises(ValueError, match="gradient_reduction='float8' is not built for a 'seq'"):
        kdist.distribution("seq=2,data=4", gradient_reduction="float8", error_feedback=True)
    with pytest.raises(ValueError, match="'seq' axis has not been built or tested together"):
        kdist.distribution("replica=2,seq=2,fsdp=2", sync_every=5)
    with pytest.raises(ValueError, match="sync_every=5 .DiLoCo. is not built for a 'seq'"):
        kdist.distribution("seq=2,fsdp=4", sync_every=5)  # one replica group
    model = _model("replica=2,fsdp=4", sync_every=5)
    with pytest.raises(ValueError, match="LossScaleOptimizer"):
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))


@pytest.mark.slow  # two processes on 127.0.0.1
def test_replica_groups_on_two_processes_train_like_one(tmp_path, monkeypatch):
    # One replica group per process (replica is the slowest axis: across hosts), synced
    # every 2 steps; the one-process run of the same script gives the same losses.
    import argparse
    import os
    import sys
    from pathlib import Path

    from kdist import launch
    from tests import multihost_script

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root),
                                                      os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, str(root / "tests" / "multihost_script.py"), "train",
               "--mesh", "replica=2,fsdp=4", "--sync-every", "2", "--steps", "3",
               "--out", str(tmp_path)]
    assert launch.launch(command, processes=2, devices_per_process=4) == 0
    ranks = [multihost_script.json.loads((tmp_path / f"train-rank{r}.json").read_text())
             for r in (0, 1)]
    reference = multihost_script.train(argparse.Namespace(
        mesh="replica=2,fsdp=4", sync_every=2, steps=3, out=str(tmp_path)))
    for rank in ranks:
        np.testing.assert_allclose(rank["losses"], reference["losses"], rtol=2e-6)

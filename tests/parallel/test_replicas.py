"""DiLoCo over the replica axis (kdist.groups.diloco): groups drift and meet, what
crosses replica groups, mid-round resume, settings. (The exact special cases — inner SGD
synced every step is synchronous SGD; 8-bit exchange inside groups — are the ``replica``
rows of tests/parallel/combinations.py.)"""

import jax
import keras
import numpy as np
import pytest

import kdist
from kdist import compiled_step, hlo
from kdist.checkpointing.state import read_arrays, state_variables
from kdist.data.lm import LMBatches
from kdist.models import GPTBackbone, GPTCausalLM
from tests.helpers import (
    TINY_GPT,
    fit_with_checkpoint,
    parity_optimizer,
    token_batches,
    train,
    weights,
)
from tests.parallel.harness import assert_trains_like_one_device

PLAIN = dict(outer_learning_rate=1.0, outer_momentum=0.0)  # the sync is a plain average


def _model(mesh, config=TINY_GPT, **dist_options):
    keras.distribution.set_distribution(kdist.distribution(mesh, **dist_options))
    keras.utils.set_random_seed(1)
    return GPTCausalLM(GPTBackbone(**config))


def test_one_group_with_a_plain_average_is_plain_training():
    # 4 steps with H = 2: the last step is a sync, so the model's (outer) weights are the
    # plain run's. (H = 1 with inner SGD and several groups: tests/parallel/combinations.py.)
    run = assert_trains_like_one_device("gpt", "replica=1,fsdp=8", sync_every=2, steps=4,
                                        **PLAIN)
    assert int(run.model.optimizer.iterations) == 4


def test_the_last_step_of_fit_ends_a_partial_round_with_a_sync():
    """2H + 1 steps of ``fit`` (H = 2) equal DiLoCo computed on one device whose last step
    ends its partial round of 1 step with the outer step: the weights, the groups' copies
    and every step's loss. (The last round was dropped: the model kept step 4's weights.)"""
    run = assert_trains_like_one_device(
        "gpt", "replica=2,data=4", sync_every=2, steps=5, fit=True,
        like={"diloco": {"groups": 2, "sync_every": 2}})
    optimizer, theta = run.model.optimizer, run.model.trainable_variables
    for i, t in zip(optimizer.groups.params, theta):  # every group goes on from θ
        np.testing.assert_array_equal(optimizer.variables[i].value, np.stack([t.value] * 2))
    assert int(optimizer.iterations) == 5
    # Outside fit (train_on_batch, as the other parity rows) no step ends a round early:
    # step 6 syncs (H = 2), step 7 leaves the groups apart from θ.
    for x, y in run.batches[:2]:
        run.model.train_on_batch(x, y)
    assert any(not np.array_equal(t.value, optimizer.variables[i].value[0])
               for i, t in zip(optimizer.groups.params, theta))


@pytest.fixture(scope="module")
def diloco_run():
    """replica=2,data=2,model=2 (tensor parallel inside each group), AdamW, H = 3."""
    keras.utils.clear_session()
    model = _model("replica=2,data=2,model=2", sync_every=3)
    losses = train(model, token_batches(4))
    return model, losses, keras.distribution.distribution()


@pytest.mark.xdist_group("diloco_run")  # (the module fixture runs once per worker)
def test_building_the_optimizer_again_adds_nothing(diloco_run):
    # Users build optimizers before restoring state; Keras' own return when built.
    optimizer = diloco_run[0].optimizer
    before = [id(v) for v in optimizer.variables]
    optimizer.build(diloco_run[0].trainable_variables)
    assert [id(v) for v in optimizer.variables] == before


@pytest.mark.xdist_group("diloco_run")
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


def _cross_group_bytes(step, groups=2):
    """Bytes across groups in the program ``step`` (a CompiledStep) compiled and ran: its
    HLO read, not compiled again (~5 CPU-s each)."""
    (program,) = step.compiled
    block = jax.device_count() // groups
    return sum(c.bytes for c in hlo.parse_collectives(program.as_text(), jax.device_count())
               if c.crosses(block))


@pytest.mark.xdist_group("diloco_run")
def test_only_the_sync_step_communicates_across_groups(diloco_run):
    model, _, dist = diloco_run
    keras.distribution.set_distribution(dist)
    # The fixture's 4 steps (H = 3) ran both of diloco.make_train_function's programs.
    inner, sync = map(_cross_group_bytes, compiled_step.steps_of(model.train_function))
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
        return model, fit_with_checkpoint(model, data, directory, steps_per_epoch=4,
                                          stop_at=stop_at)

    # 8 steps: rounds end at 3, 6 and (fit's last step, a partial round) 8.
    full_model, full = run(tmp_path / "full")
    # Stopped after step 5, two inner steps into round 2 and mid-epoch: the resumed fit runs
    # the 3 steps left of its last epoch (Checkpoint.epoch_batches) and syncs at the last.
    _, first = run(tmp_path / "split", stop_at=5)
    model, second = run(tmp_path / "split")
    assert first + second == full  # bit-exact: groups' weights, inner and outer state
    resumed, reference = weights(model), weights(full_model)
    assert all(np.array_equal(resumed[k], reference[k]) for k in reference)
    # Step 8's checkpoint, saved as the step ended, holds the synchronised weights.
    variables = state_variables(full_model)
    keys = [k for k in variables if k.startswith("params.")]
    saved = read_arrays(tmp_path / "full" / "8", variables, keys)
    assert all(np.array_equal(saved[k], variables[k].value) for k in keys)


def test_replica_settings_are_checked():
    with pytest.raises(ValueError, match="need sync_every=H"):
        kdist.distribution("replica=2,fsdp=4")
    with pytest.raises(ValueError, match="sync_every must be a positive integer"):
        kdist.distribution("replica=2,fsdp=4", sync_every=0)
    with pytest.raises(ValueError, match="outer_momentum must be a number in"):
        kdist.distribution("replica=2,fsdp=4", sync_every=5, outer_momentum=1.0)
    with pytest.raises(ValueError, match="outer_learning_rate must be a finite number"):
        kdist.distribution("replica=2,fsdp=4", sync_every=5, outer_learning_rate=float("nan"))
    model = _model("replica=2,fsdp=4", sync_every=5)
    with pytest.raises(ValueError, match="LossScaleOptimizer"):
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))


@pytest.mark.slow  # two processes on 127.0.0.1
@pytest.mark.xdist_group("multihost")  # one worker launches the processes once
def test_replica_groups_on_two_processes_train_like_one(multihost_cases):
    # One replica group per process (replica is the slowest axis: across hosts), synced
    # every 2 steps; the one-process run of the same script gives the same losses.
    import argparse

    from tests import multihost_script

    name = "train replica=2,fsdp=4"
    ranks = multihost_cases.ranks(name)
    reference = multihost_script.train(argparse.Namespace(
        mesh="replica=2,fsdp=4", sync_every=2, steps=3, out=str(multihost_cases.out(name))))
    for rank in ranks:
        np.testing.assert_allclose(rank["losses"], reference["losses"], rtol=2e-6)

"""Checkpoint: exact resume, damaged and partial steps, disk full, resharding, signals."""

import errno
import json
import signal
import time

import jax
import keras
import numpy as np
import pytest

import kdist
from kdist.callbacks import Checkpoint, CheckpointError, Throughput
from kdist.checkpointing import committed_steps, read_metadata, verify_step
from kdist.data.lm import LMBatches
from tests.checkpointing.checkpoint_worker import start_worker
from tests.helpers import (
    TINY_GPT,
    ProcessOutput,
    parity_optimizer,
    tiny_gpt,
    weights,
)

TOKENS = np.random.default_rng(0).integers(0, 256, size=4000).astype(np.int32)


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


def run(directory, epochs, stop_at=None, mesh=None, steps_per_epoch=4, throughput=None,
        **ckpt_args):
    """A fresh tiny GPT (dropout on) trained by fit on LMBatches with a Checkpoint (and a
    ``throughput`` callback, if given)."""
    keras.utils.clear_session()
    model = tiny_gpt(mesh, dropout=0.1)
    model.compile(optimizer=parity_optimizer())
    data = LMBatches(TOKENS, sequence_length=16, global_batch_size=8, seed=3)
    record = Record(stop_at)
    ckpt = Checkpoint(directory, data=data, verbose=False, handle_signals=False,
                      throughput=throughput, **{"save_every_steps": 3, **ckpt_args})
    if throughput:  # restored before fit, as the recipes do: Throughput counts from there
        ckpt.restore(model)
    model.fit(data, epochs=epochs, steps_per_epoch=steps_per_epoch, shuffle=False, verbose=0,
              callbacks=[record, *([throughput] if throughput else []), ckpt])
    return model, record, ckpt, data


def throughput():
    """A Throughput logging every 2 steps to its rows only (no peak measured)."""
    return Throughput(8, 16, log_every=2, peak_tflops=1.0, tensorboard=False,
                      progress_bar=False)


def step_losses(callback):
    """{optimizer step: its own loss} of a Throughput's interval rows."""
    return {s: v for r in callback.rows if r["kind"] == "interval" for s, v in r["step_losses"]}


def test_resume_mid_epoch_is_bit_exact(tmp_path):
    full_model, full, _, _ = run(tmp_path / "full", epochs=3, throughput=(whole := throughput()))
    # Stop at step 6 (epoch 1, after 2 of its 4 steps); the final save commits step 6.
    _, first, ckpt, _ = run(tmp_path / "split", epochs=3, stop_at=6,
                            throughput=(before := throughput()))
    assert committed_steps(tmp_path / "split") == [3, 6]
    assert read_metadata(tmp_path / "split" / "6")["data_step"] == 6
    model, second, ckpt, data = run(tmp_path / "split", epochs=3,
                                    throughput=(after := throughput()))
    # Each step's own loss, the resumed epoch's too (its running mean holds steps 5-6).
    assert list(step_losses(after)) == [7, 8, 9, 10, 11, 12]
    np.testing.assert_allclose([*step_losses(before).values(), *step_losses(after).values()],
                               list(step_losses(whole).values()), rtol=1e-5)
    assert ckpt.restored_step == 6 and data.start_step == 6  # data resumes at batch 6
    assert second.epochs == [1, 2]  # fit started in the interrupted epoch
    assert len(first.losses) + len(second.losses) == 12  # no batch repeated or skipped
    assert first.losses + second.losses == full.losses  # bit-exact, every step
    resumed, reference = weights(model), weights(full_model)
    assert all(np.array_equal(resumed[k], reference[k]) for k in reference)
    assert committed_steps(tmp_path / "split") == [6, 9, 12]  # keep=3


def test_skip_to_moves_the_step_data_and_optimizer_on_without_training(tmp_path):
    """What a replica group rejoining a job that went on does (kdist.groups.skip_to_job):
    restored at step 3, skipped to 9, fit trains steps 10-12 from data position 9."""
    run(tmp_path, epochs=1, steps_per_epoch=3)
    keras.utils.clear_session()
    model = tiny_gpt(None, dropout=0.1)
    model.compile(optimizer=parity_optimizer())
    data = LMBatches(TOKENS, sequence_length=16, global_batch_size=8, seed=3)
    ckpt = Checkpoint(tmp_path, data=data, verbose=False, handle_signals=False,
                      save_every_steps=3)
    with pytest.raises(ValueError, match="call restore"):
        ckpt.skip_to(9, model)
    assert ckpt.restore(model) == 3
    before = weights(model)
    assert ckpt.skip_to(2, model) == 3  # never backwards
    assert ckpt.skip_to(9, model) == 9
    assert data.start_step == 9 and int(model.optimizer._iterations.value) == 9
    assert all(np.array_equal(before[k], v) for k, v in weights(model).items())
    record, logged = Record(), throughput()
    ckpt.throughput = logged
    model.fit(data, epochs=3, steps_per_epoch=4, shuffle=False, verbose=0,
              callbacks=[record, logged, ckpt])
    assert record.epochs == [2] and len(record.losses) == 3  # steps 10-12, mid-epoch 2
    # No mean restored (it was the old step's): each step's loss from Keras' fresh mean.
    assert list(step_losses(logged)) == [10, 11, 12]
    assert step_losses(logged)[10] == pytest.approx(record.losses[0])
    assert committed_steps(tmp_path)[-1] == 12
    assert read_metadata(tmp_path / "12")["data_step"] == 12


class Capture(keras.callbacks.Callback):
    """Host copies of the weights after given steps (to check what an async save wrote)."""

    def __init__(self, steps):
        super().__init__()
        self.steps, self.step, self.weights = steps, 0, {}

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.step in self.steps:
            self.weights[self.step] = weights(self.model)


def fresh(mesh, devices=None):
    keras.utils.clear_session()
    keras.distribution.set_distribution(kdist.distribution(mesh, devices) if mesh else None)
    keras.utils.set_random_seed(1)
    model = kdist.models.GPTCausalLM(kdist.models.GPTBackbone(**TINY_GPT, dropout=0.1))
    model.compile(optimizer=parity_optimizer())
    return model


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """4 steps under fsdp=8, saved asynchronously at step 2 while training went on."""
    directory = tmp_path_factory.mktemp("fsdp") / "ckpt"
    keras.utils.clear_session()
    model = tiny_gpt("fsdp=8", dropout=0.1)
    model.compile(optimizer=parity_optimizer())
    data = LMBatches(TOKENS, sequence_length=16, global_batch_size=8, seed=3)
    capture = Capture({2, 4})
    model.fit(data, epochs=1, steps_per_epoch=4, verbose=0, callbacks=[capture, Checkpoint(
        directory, save_every_steps=2, data=data, verbose=False, handle_signals=False)])
    keras.distribution.set_distribution(None)
    return directory, capture.weights


@pytest.mark.xdist_group("fsdp_run")  # the module fixture once, not per worker
@pytest.mark.parametrize("mesh, devices", [("model=4", 4), (None, 1)])
def test_restore_reshards_into_the_new_layout(fsdp_run, mesh, devices):
    directory, saved = fsdp_run
    model = fresh(mesh, jax.devices()[:devices] if mesh else None)
    data = LMBatches(TOKENS, sequence_length=16, global_batch_size=8, seed=3)
    ckpt = Checkpoint(directory, data=data, verbose=False)
    assert ckpt.restore(model, step=2) == 2 and data.start_step == 2
    for w in model.weights:  # the async save (training went on) holds step 2's values
        np.testing.assert_array_equal(np.asarray(w.value), saved[2][w.path], err_msg=w.path)
        expected = keras.distribution.distribution()
        if expected is None:
            assert len(w.value.sharding.device_set) == 1
        else:
            spec = expected.get_variable_layout(w).backend_layout
            assert w.value.sharding.is_equivalent_to(spec, w.value.ndim), w.path
    assert int(model.optimizer.iterations.numpy()) == 2
    assert ckpt.restore(model) == 4  # the newest


@pytest.mark.xdist_group("fsdp_run")
def test_shape_mismatch_names_the_variable_and_both_shapes(fsdp_run):
    directory, _ = fsdp_run
    keras.utils.clear_session()
    model = tiny_gpt(None, hidden_dim=32, intermediate_dim=64)
    model.compile(optimizer=parity_optimizer())
    with pytest.raises(ValueError, match=r"token_embedding/embeddings: checkpoint shape "
                                         r"\(256, 64\), model shape \(256, 32\)"):
        Checkpoint(directory, data="restart").restore(model)
    keras.utils.clear_session()
    deeper = tiny_gpt(None, num_layers=3)
    deeper.compile(optimizer=parity_optimizer())
    with pytest.raises(ValueError, match=r"block_2/attention/query/kernel \(shape \(64, 8, 8\)\) "
                                         r"is not in the checkpoint"):
        Checkpoint(directory, data="restart").restore(deeper)


def damage(step_dir, how):
    """Truncates, or flips bytes in place of (same size), the step's biggest array file."""
    biggest = max((f for f in step_dir.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data = biggest.read_bytes()
    if how == "truncate":
        biggest.write_bytes(data[:len(data) // 2])
    else:
        middle = len(data) // 2
        biggest.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 8])
                            + data[middle + 8:])
    return biggest


def test_damaged_newest_falls_back_or_names_the_file(tmp_path):
    run(tmp_path, epochs=2, save_every_steps=4)  # steps 4 and 8
    biggest = damage(tmp_path / "8", "truncate")
    assert str(biggest) in verify_step(tmp_path / "8")[0]
    with pytest.raises(CheckpointError, match=f"{biggest}.*truncated"):
        Checkpoint(tmp_path, data="restart").restore(fresh(None), step=8)
    # A step directory without the commit marker does not count (and is moved aside); with no
    # intact step left, nothing is moved aside.
    marker = (tmp_path / "4" / "kdist.json").read_bytes()
    (tmp_path / "4" / "kdist.json").unlink()
    assert committed_steps(tmp_path) == [8]
    with pytest.raises(CheckpointError, match="No intact checkpoint.*step 8"):
        Checkpoint(tmp_path, data="restart").restore(fresh(None))
    assert committed_steps(tmp_path) == [8]
    (tmp_path / "4" / "kdist.json").write_bytes(marker)
    model = fresh(None)
    with pytest.warns(UserWarning, match=f"step 8 is damaged; moved it aside to .*8.damaged-"
                                         f".*resumed from step 4.*{biggest.name}"):
        assert Checkpoint(tmp_path, data="restart", verbose=False).restore(model) == 4
    aside = [p.name for p in tmp_path.iterdir() if ".damaged-" in p.name]
    assert len(aside) == 1 and aside[0].startswith("8.damaged-")
    assert committed_steps(tmp_path) == [4]


def test_a_step_that_lost_only_its_marker_is_moved_aside_not_deleted(tmp_path):
    run(tmp_path, epochs=1, save_every_steps=2)  # steps 2 and 4
    (tmp_path / "4" / "kdist.json").unlink()  # the arrays are all there
    arrays = sorted(p.relative_to(tmp_path / "4") for p in (tmp_path / "4").rglob("*"))
    with pytest.warns(UserWarning, match=r"step 4 has no kdist.json \(its commit marker was "
                                         r"lost\); moved it aside to .*4.damaged-"):
        _, _, ckpt, _ = run(tmp_path, epochs=1, save_every_steps=2)  # resumes from 2
    assert ckpt.restored_step == 2 and committed_steps(tmp_path) == [2, 4]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("4.damaged-")]
    assert len(aside) == 1
    assert sorted(p.relative_to(aside[0]) for p in aside[0].rglob("*")) == arrays


def test_after_a_fallback_training_saves_the_damaged_steps_number_again(tmp_path):
    # issue 19: the rerun fell back to step 4, trained, then failed to save step 8
    # (StepAlreadyExistsError) in a loop.
    _, full, _, _ = run(tmp_path / "full", epochs=2, save_every_steps=4)
    run(tmp_path / "run", epochs=2, save_every_steps=4)
    damage(tmp_path / "run" / "8", "truncate")
    with pytest.warns(UserWarning, match="step 8 is damaged; moved it aside"):
        _, second, ckpt, _ = run(tmp_path / "run", epochs=2, save_every_steps=4)
    assert ckpt.restored_step == 4 and ckpt.committed_step == 8
    assert committed_steps(tmp_path / "run") == [4, 8]
    assert verify_step(tmp_path / "run" / "8") == []
    assert second.losses == full.losses[4:]


def test_flipped_bytes_are_caught_by_the_checksums(tmp_path):
    run(tmp_path, epochs=2, save_every_steps=4)  # steps 4 and 8
    assert set(read_metadata(tmp_path / "8")["checksums"]) == set(
        read_metadata(tmp_path / "8")["files"])
    flipped = damage(tmp_path / "8", "flip")
    problems = verify_step(tmp_path / "8")
    assert len(problems) == 1 and str(flipped) in problems[0] and "checksum" in problems[0]
    assert verify_step(tmp_path / "8", checksums=False) == []  # same size: sizes alone pass
    with pytest.warns(UserWarning, match=f"step 8 is damaged.*{flipped.name}.*checksum"):
        assert Checkpoint(tmp_path, data="restart", verbose=False).restore(fresh(None)) == 4


def test_disk_full_fails_loudly_and_keeps_the_previous_step(tmp_path, monkeypatch):
    from orbax.checkpoint._src.serialization import serialization

    run(tmp_path, epochs=1, save_every_steps=4)  # step 4 committed
    before = {f: f.stat().st_size for f in (tmp_path / "4").rglob("*") if f.is_file()}

    async def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(serialization, "async_serialize_from_host", disk_full)
    with pytest.raises(CheckpointError, match=r"failed \(disk full\).*Committed steps still "
                                              r"there: \[4\]"):
        run(tmp_path, epochs=2, save_every_steps=2)  # resumes at 4, async save of 6 fails
    monkeypatch.undo()
    assert committed_steps(tmp_path) == [4] and verify_step(tmp_path / "4") == []
    assert before == {f: f.stat().st_size for f in (tmp_path / "4").rglob("*") if f.is_file()}
    assert Checkpoint(tmp_path, data="restart", verbose=False).restore(fresh(None)) == 4


def test_retention_time_trigger_and_non_finite_weights(tmp_path):
    # Every step by time (1 ns), newest 2 kept plus every multiple of 2.
    _, _, ckpt, _ = run(tmp_path, epochs=1, save_every_steps=None, save_every_seconds=1e-9,
                        keep=2, keep_every=2)
    assert committed_steps(tmp_path) == [2, 3, 4]
    ckpt._open_manager()
    ckpt._variables["params.final_norm.gamma"].assign(
        np.full((64,), np.nan, "float32"))
    ckpt.step = 6
    with pytest.warns(UserWarning, match="not saving step 6.*not finite.*step 4"):
        ckpt.save(wait=True)
    with pytest.warns(UserWarning, match="not saving step 6: the loss \\(nan\\)"):
        ckpt._variables["params.final_norm.gamma"].assign(np.ones((64,), "float32"))
        ckpt.save(wait=True, loss=float("nan"))
    ckpt._close()
    assert committed_steps(tmp_path) == [2, 3, 4]  # nothing saved, nothing rotated out


def test_resume_flags(tmp_path):
    with pytest.raises(CheckpointError, match="resume='required' but .* holds no committed"):
        Checkpoint(tmp_path / "none", resume="required").restore(fresh(None))
    _, _, ckpt, _ = run(tmp_path / "a", epochs=1)  # step 4 committed
    with pytest.raises(ValueError, match="already holds checkpoints"):
        Checkpoint(tmp_path / "a", resume="never")
    # init_from: weights only, and only when there is nothing to resume.
    model = fresh(None)
    init = Checkpoint(tmp_path / "b", init_from=tmp_path / "a", data="restart", verbose=False)
    assert init.restore(model) == 0
    assert int(model.optimizer.iterations.numpy()) == 0
    source = read_metadata(tmp_path / "a" / "4")
    assert source["step"] == 4 and "GPTCausalLM" in json.dumps(source["model_config"])
    model2 = fresh(None)
    resumed = Checkpoint(tmp_path / "a", init_from=tmp_path / "elsewhere", data="restart",
                         verbose=False)
    assert resumed.restore(model2) == 4  # init_from ignored
    np.testing.assert_array_equal(weights(model)["final_norm/gamma"],
                                  weights(model2)["final_norm/gamma"])
    with pytest.raises(ValueError, match="has no dataset to position"):
        Checkpoint(tmp_path / "a").restore(fresh(None))
    # init_from a Keras weights file.
    source_model = fresh(None)
    source_model.weights[0].assign(np.zeros(source_model.weights[0].shape, "float32"))
    source_model.save_weights(tmp_path / "w.weights.h5")
    target = fresh(None)
    Checkpoint(tmp_path / "c", init_from=tmp_path / "w.weights.h5", verbose=False).restore(target)
    assert not np.asarray(target.weights[0].value).any()


def said(word):
    """A predicate for ProcessOutput.wait_for: the worker printed ``word`` on a line."""
    return lambda lines: f"{word}\n" in lines


@pytest.mark.slow
def test_kill_9_during_a_save_resumes_from_the_last_committed_step(tmp_path):
    directory = tmp_path / "ckpt"
    worker = ProcessOutput(start_worker(directory, "hang-in-save"))
    worker.wait_for(said("in_save"), timeout=300)
    worker.proc.kill()  # SIGKILL while step 4 is written but not committed
    worker.finish(timeout=60)
    assert committed_steps(directory) == [2]
    assert [p.name for p in directory.iterdir() if "tmp" in p.name] == ["4.orbax-checkpoint-tmp"]
    restart = start_worker(directory, "train")
    out = restart.communicate(timeout=300)[0]
    assert restart.returncode == 0, out
    assert "DONE restored=2 step=8" in out
    assert "Checkpoint: removed" in out and "interrupted save" in out
    assert committed_steps(directory) == [4, 6, 8]
    assert not [p for p in directory.iterdir() if "tmp" in p.name]


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_exits(tmp_path):
    directory = tmp_path / "ckpt"
    worker = ProcessOutput(start_worker(directory, "until-signal"))
    worker.wait_for(said("running"), timeout=300)
    worker.proc.send_signal(signal.SIGTERM)
    status, out = worker.finish(timeout=300)
    assert status == 128 + signal.SIGTERM, out
    assert "DONE" not in out  # exited, did not return from fit
    steps = committed_steps(directory)
    assert len(steps) == 1 and steps[0] >= 3, out
    assert f"SIGTERM received; step {steps[0]} is committed" in out
    assert verify_step(directory / str(steps[0])) == []
    assert read_metadata(directory / str(steps[0]))["data_step"] == steps[0]


def test_unwritable_directory_fails_before_the_first_step(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    directory = tmp_path / "file" / "ckpt"
    model = fresh(None)
    data = LMBatches(TOKENS, sequence_length=16, global_batch_size=8, seed=3)
    record = Record()
    with pytest.raises(CheckpointError, match=f"{directory} is not writable.*Fix its "):
        model.fit(data, epochs=1, steps_per_epoch=4, verbose=0, callbacks=[
            record, Checkpoint(directory, data=data, save_every_steps=2, verbose=False)])
    assert record.losses == []  # nothing trained
    with pytest.raises(CheckpointError, match="is not writable"):
        Checkpoint(directory, data="restart").restore(fresh(None))


@pytest.mark.slow
def test_a_failed_save_exits_promptly(tmp_path):
    # issue 19: orbax waited 5 minutes for a step directory it could not create.
    directory = tmp_path / "ckpt"
    worker = start_worker(directory, "unwritable")
    started = time.monotonic()
    out = worker.communicate(timeout=240)[0]
    assert "broken" in out and worker.returncode not in (0, None), out
    assert f"Saving a checkpoint to {directory} failed" in out and "is not writable" in out
    assert time.monotonic() - started < 120, out


@pytest.mark.slow
def test_sigterm_skips_the_epoch_end_validation(tmp_path):
    directory = tmp_path / "ckpt"
    worker = ProcessOutput(start_worker(directory, "until-signal-validation"))
    worker.wait_for(said("running"), timeout=300)
    sent = time.monotonic()
    worker.proc.send_signal(signal.SIGTERM)
    worker.wait_for(lambda lines: any(" committed to " in x for x in lines), timeout=120)
    committed = time.monotonic() - sent
    status, out = worker.finish(timeout=120)
    exited = time.monotonic() - sent
    assert status == 128 + signal.SIGTERM, out
    assert "evaluating" not in out and "DONE" not in out, out
    steps = committed_steps(directory)
    assert len(steps) == 1 and f"SIGTERM received; step {steps[0]} is committed" in out
    print(f"\nSIGTERM -> step committed {committed:.2f} s, -> process exited {exited:.2f} s")


def test_a_run_saved_with_data_restart_resumes(tmp_path):
    # data="restart" saves no data position (data_step None); restoring it used to fail.
    model = fresh(None)
    data = LMBatches(TOKENS, sequence_length=16, global_batch_size=8, seed=3)
    model.fit(data, epochs=1, steps_per_epoch=2, verbose=0, callbacks=[Checkpoint(
        tmp_path, data="restart", save_every_steps=2, verbose=False, handle_signals=False)])
    assert read_metadata(tmp_path / "2")["data_step"] is None
    assert Checkpoint(tmp_path, data="restart", verbose=False).restore(fresh(None)) == 2


def test_commit_is_announced_only_once_the_step_is_in_place(tmp_path, monkeypatch):
    # issue 19: "step N committed" was printed before orbax renamed the step into place.
    from kdist.checkpointing import callback

    seen = []

    def on_checkpoint(step, step_dir):
        seen.append((step, step_dir.is_dir(), verify_step(step_dir) == [],
                     not list(tmp_path.glob(f"{step}.orbax-checkpoint-tmp*"))))

    synced = []
    real_fsync = callback.fsync_tree
    monkeypatch.setattr(callback, "fsync_tree", lambda p: (real_fsync(p), synced.append(p.name)))
    run(tmp_path, epochs=1, save_every_steps=2, on_checkpoint=on_checkpoint)
    assert seen == [(2, True, True, True), (4, True, True, True)]
    assert synced == ["2", "4"]

"""``Checkpoint``: the Keras callback — when to save, resume, preemption, several processes.
Storage is :mod:`kdist.checkpointing.format` (layout, commit marker), ``metadata`` and
``verify`` (sizes and SHA-256 checksums); this module is the state machine around ``fit``.

What it guarantees, why not Keras' own callbacks, several processes: see
:mod:`kdist.checkpointing`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import keras
import numpy as np

from kdist import _keras_compat
from kdist import orbax_writer as writer
from kdist.checkpointing.agreement import any_process, check_writable_everywhere, save_failed
from kdist.checkpointing.format import (
    TMP_MARK,
    CheckpointError,
    clean_partial,
    committed_steps,
    listing,
)
from kdist.checkpointing.metadata import describe, write_commit_marker
from kdist.checkpointing.restore import load_initial_weights, newest_intact
from kdist.checkpointing.state import all_finite, loss_mean, state_variables
from kdist.durable import fsync_tree


class Checkpoint(keras.callbacks.Callback):
    """Asynchronous, atomic, verified, exactly-resuming checkpoints of a ``model.fit`` run.

    Args:
        directory: one directory per run; step ``s`` goes to ``directory/<s>/``.
        save_every_steps: save when the training step (``fit`` batches since the start of
            the run) is a multiple of this.
        save_every_seconds: also save when this many seconds passed since the last save.
        keep: newest committed steps to keep.
        keep_every: also keep every step that is a multiple of this (never deleted).
        data: the training dataset, an object with a ``start_step`` attribute (kdist's
            ``LMBatches``): it is set to the restored data position so no batch is
            repeated or skipped. ``"restart"`` accepts restarting the data from its start.
        resume: ``"auto"`` (resume if a committed step exists), ``"required"`` (fail if
            none) or ``"never"`` (fail if the directory already holds checkpoints).
        init_from: weights only (no optimizer, step or data position) from another
            checkpoint directory, one of its step directories, or a ``.keras`` /
            ``.weights.h5`` file; ignored when ``directory`` has a step to resume.
        async_save: write in the background (training continues once arrays are copied to
            the host); False waits for each save.
        handle_signals: on SIGTERM/SIGINT save the current step and exit after commit.
        exit_on_signal: exit status ``128 + signal`` after that save (else ``fit`` just
            returns, with ``interrupted_by`` set). Put this callback last in the list:
            callbacks after it get no ``on_train_end`` when it exits.
        throughput: a ``kdist.callbacks.Throughput`` told of blocking waits and resumed means.
        on_checkpoint: called as ``on_checkpoint(step, step_dir)`` once a step is durable
            (from a background thread, in every process).
        verbose: print one line per restore and per committed save.

    Example:
        >>> ckpt = Checkpoint("runs/ckpt", save_every_steps=100, data=data.train)  # doctest: +SKIP
        >>> model.fit(data.train, epochs=10, steps_per_epoch=50, callbacks=[ckpt])  # doctest: +SKIP

    ``fit`` then resumes by itself: run the same script again and it continues from the
    newest committed step. To know the step before ``fit`` (e.g. to size the data), call
    ``ckpt.restore(model)`` first; ``fit`` then does not restore again.
    """

    def __init__(self, directory: str | os.PathLike, save_every_steps: int | None = None,
                 save_every_seconds: float | None = None, keep: int = 3,
                 keep_every: int | None = None, data: Any = None, resume: str = "auto",
                 init_from: str | os.PathLike | None = None, async_save: bool = True,
                 handle_signals: bool = True, exit_on_signal: bool = True, throughput: Any = None,
                 on_checkpoint: Callable[[int, Path], None] | None = None, verbose: bool = True):
        super().__init__()
        for name, value in (("save_every_steps", save_every_steps), ("keep_every", keep_every)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None; got {value!r}.")
        if save_every_seconds is not None and not save_every_seconds > 0:
            raise ValueError(f"save_every_seconds must be > 0 or None; got {save_every_seconds!r}.")
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer (newest steps kept); got {keep!r}.")
        if resume not in ("auto", "required", "never"):
            raise ValueError(f"resume must be 'auto', 'required' or 'never'; got {resume!r}.")
        if data is not None and data != "restart" and not hasattr(data, "start_step"):
            raise ValueError(
                f"data must have a start_step attribute (like kdist.data.LMBatches) so the "
                f"data position can be restored, or be 'restart'; got {type(data).__name__}."
            )
        self.directory = Path(directory).absolute()
        self.save_every_steps, self.save_every_seconds = save_every_steps, save_every_seconds
        self.keep, self.keep_every = keep, keep_every
        self.data = data
        self.resume = resume
        self.init_from = init_from
        self.async_save = async_save
        self.handle_signals = handle_signals
        self.exit_on_signal = exit_on_signal
        self.throughput = throughput
        self.on_checkpoint = on_checkpoint
        self.verbose = verbose
        if resume == "never" and committed_steps(self.directory):
            raise ValueError(
                f"{self.directory} already holds checkpoints (steps "
                f"{committed_steps(self.directory)}) and resume='never'. Use another "
                f"directory, delete it, or pass resume='auto' to continue that run."
            )
        self.step = 0  # training steps done (fit batches since the run began)
        self.data_step = None  # the data position restored, if any
        self.restored_step = None
        self.epoch_batches = None  # an epoch resumed mid-way: its rest (read by DiLoCo's FitEnd)
        self.committed_step = None  # the newest step announced durable by this run
        self.interrupted_by = None
        self._manager = None
        self._pending: dict[str, Any] | None = None
        self._finisher: threading.Thread | None = None
        self._finish_error: BaseException | None = None
        self._saved_step = None
        self._restored_metrics: dict[str, np.ndarray] = {}
        self._signal = None
        self._old_handlers: dict[int, Any] = {}

    @property
    def _fit_model(self):  # the model fit runs, without Callback.model's JAX state sync
        return _keras_compat.callback_model(self)

    def get_config(self) -> dict[str, Any]:
        return {"directory": str(self.directory), "save_every_steps": self.save_every_steps,
                "save_every_seconds": self.save_every_seconds, "keep": self.keep,
                "keep_every": self.keep_every, "resume": self.resume,
                "init_from": None if self.init_from is None else str(self.init_from),
                "async_save": self.async_save, "handle_signals": self.handle_signals,
                "exit_on_signal": self.exit_on_signal, "verbose": self.verbose}

    # --- restore ---

    def restore(self, model: keras.Model | None = None, step: int | None = None) -> int:
        """Restores the newest intact committed step (or ``step``) into ``model``.

        Falls back to the next older step, with a warning naming the damaged file, when
        the newest is incomplete or corrupt (sizes and checksums are checked); the damaged
        step is moved aside to ``<step>.damaged-<time>`` once an older intact one is found
        (so training saves that step number again). Asking for ``step`` explicitly fails
        instead. With no step to resume, applies ``init_from`` if set (weights only) and
        returns 0. Sets the dataset's ``start_step`` (``data=``). Returns the training step
        to continue from. Fails first if ``directory`` is not writable.

        Example:
            >>> step = Checkpoint("runs/gpt/ckpt").restore(model)  # doctest: +SKIP
        """
        model = model if model is not None else self._fit_model
        variables = state_variables(model)
        candidates = committed_steps(self.directory)
        if step is not None:
            if step not in candidates:
                raise CheckpointError(f"Step {step} is not a committed checkpoint in "
                                      f"{self.directory}; committed: {candidates}.")
            candidates = [step]
        if not candidates and self.resume == "required":
            raise CheckpointError(
                f"resume='required' but {self.directory} holds no committed checkpoint "
                f"(found: {listing(self.directory)}). Check the path, or drop --resume "
                f"to start a new run."
            )
        check_writable_everywhere(self.directory)
        if not candidates:
            self.restored_step = 0
            if self.init_from is not None:
                source = load_initial_weights(model, variables, Path(self.init_from))
                if self.verbose:
                    print(f"Checkpoint: initialised weights from {source} (optimizer and "
                          f"step fresh)")
            return 0
        step_dir, meta, values = newest_intact(self.directory, variables, candidates,
                                               explicit=step is not None)
        for key in values.keys() & variables.keys():  # seeds may not convert (layer_layout)
            variables[key].assign(values[key])
        self._restored_metrics = {k: values[k] for k in variables if k.startswith("metrics.")}
        self.step = self.restored_step = int(meta["step"])
        data_step = meta.get("data_step")  # None: saved with data="restart"
        self.data_step = int(meta["step"] if data_step is None else data_step)
        self._saved_step = self.step
        self._position_data()
        if self.verbose:
            print(f"Checkpoint: resumed from {step_dir} (step {self.step}, data position "
                  f"{self.data_step}, loss {meta.get('loss')})")
        return self.step

    def skip_to(self, step: int, model: keras.Model | None = None) -> int:
        """After :meth:`restore`, moves the run on to ``step`` untrained: the optimizer's step
        counter and the data position advance alike, weights and slots stay (a replica group
        rejoining a job that went on: :func:`kdist.groups.skip_to_job`). Returns the step."""
        if self.restored_step is None:
            raise ValueError("Checkpoint.skip_to moves a restored run on: call restore() first.")
        skipped = step - self.step
        if skipped > 0:
            model = model if model is not None else self._fit_model
            if self.data not in (None, "restart"):
                self.data_step = self.data.start_step = skipped + (
                    self.data.start_step if self.data_step is None else self.data_step)
            _keras_compat.optimizer_iterations(model.optimizer).assign_add(skipped)
            self.step = self.restored_step = step
            self._restored_metrics = {}  # a partial epoch's means belong to the old step
        return self.step

    def _position_data(self):
        if self.data is None and self.restored_step:
            raise ValueError(
                f"Checkpoint restored step {self.restored_step}, but has no dataset to "
                f"position: pass data=<your training dataset> (with a start_step attribute, "
                f"like kdist.data.LMBatches) so batches are neither repeated nor skipped, or "
                f"data='restart' to accept restarting the data from its beginning."
            )
        if self.data not in (None, "restart"):
            self.data.start_step = self.data_step

    # --- fit hooks ---

    def on_train_begin(self, logs=None):
        model = self._fit_model
        positioned = self.data not in (None, "restart")
        if getattr(self, "_trained", False):  # another fit with this callback: continue
            if positioned:
                self.data.start_step = self._data_base + self.step
        else:
            if self.restored_step is None:
                self.restore(model)
            elif self.restored_step:
                self._position_data()  # restore() ran before fit: check the data again
            # data position = _data_base + training step, for every later save
            self._data_base = self.data.start_step - self.step if positioned else None
        check_writable_everywhere(self.directory)  # before the first step, not at the first save
        self._variables = state_variables(model)
        self._steps_per_epoch = self.params.get("steps") if self.params else None
        if self.restored_step and self._steps_per_epoch and not getattr(self, "_trained", False):
            _keras_compat.set_initial_epoch(model, self.step // self._steps_per_epoch)
        # Only the first fit after a restore can start inside an epoch.
        self._first_epoch = bool(self.restored_step) and not getattr(self, "_trained", False)
        self._signal = self.interrupted_by = None
        self._last_save_time = time.monotonic()
        self._open_manager()
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def on_epoch_begin(self, epoch, logs=None):
        self._batch_base, self.epoch_batches = self.step, None  # batches from 0 per epoch
        if self._first_epoch and self._steps_per_epoch:
            done = self.step - epoch * self._steps_per_epoch
            if 0 < done < self._steps_per_epoch:
                # Resumed mid-epoch: continue its running means, run only the rest of it.
                for key, value in self._restored_metrics.items():
                    self._variables[key].assign(value)
                self.epoch_batches = self._steps_per_epoch - done
                if self.throughput is not None:  # its per-step losses go on from this mean
                    self.throughput.resume_epoch_mean(epoch, *loss_mean(self._restored_metrics))
        self._first_epoch = False

    def on_train_batch_end(self, batch, logs=None):
        self.step = self._batch_base + batch + 1
        due = bool(self.save_every_steps and self.step % self.save_every_steps == 0)
        if self.save_every_seconds:
            due |= time.monotonic() - self._last_save_time >= self.save_every_seconds
        interrupted = self._signal is not None
        if self.save_every_seconds or self.handle_signals:
            due, interrupted = any_process([due, interrupted])
        loss = (logs or {}).get("loss")
        if interrupted:
            self.interrupted_by = self._signal or signal.SIGTERM
            self._save(loss, wait=True)  # committed and durable before anything else runs
            self._fit_model.stop_training = True
        elif due:
            self._save(loss, wait=not self.async_save)
        if self.epoch_batches is not None and batch + 1 >= self.epoch_batches:
            # The resumed epoch is complete: end it here; on_epoch_end lets fit go on.
            self._fit_model.stop_training = True
            self._ending_partial_epoch = not interrupted

    def on_test_begin(self, logs=None):
        # fit validates even after stop_training: a preempted run exits here instead (or,
        # with exit_on_signal=False, stops the validation after one batch).
        if self.interrupted_by is not None and self._manager is not None:
            if self.exit_on_signal:
                self._end_run()
                self._exit()
            self._fit_model.stop_evaluating = True

    def on_epoch_end(self, epoch, logs=None):
        if getattr(self, "_ending_partial_epoch", False):
            self._ending_partial_epoch = False
            if self.interrupted_by is None:
                _keras_compat.end_fit_epoch()
                self._fit_model.stop_training = False

    def on_train_end(self, logs=None):
        try:
            if self._saved_step != self.step:
                self._save((logs or {}).get("loss"), wait=True)
            self._wait()
        finally:
            self._end_run()
        if self.interrupted_by is not None and self.exit_on_signal:
            self._exit()

    def _end_run(self):
        self._trained = True
        try:
            self._close()
        finally:
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
            self._old_handlers.clear()
            _keras_compat.set_initial_epoch(self._fit_model, None)

    def _exit(self):
        print(f"Checkpoint: {signal.Signals(self.interrupted_by).name} received; step "
              f"{self.step} is committed in {self.directory}. Exiting.", flush=True)
        raise SystemExit(128 + int(self.interrupted_by))

    def _on_signal(self, signum, frame):
        if self._signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: stop now, without waiting
        self._signal = signum

    # --- saving ---

    def save(self, wait: bool | None = None, loss: float | None = None) -> None:
        """Saves the current step now (between ``on_train_begin`` and ``on_train_end``).

        ``wait`` defaults to ``not async_save``. For custom loops and benchmarks; inside
        ``fit`` the callback saves by itself.

        Example:
            >>> ckpt.save(wait=True)  # doctest: +SKIP
        """
        if self._manager is None:
            raise CheckpointError("Checkpoint.save() needs an open run: call it during fit "
                                  "(or after on_train_begin()).")
        self._save(loss, wait=not self.async_save if wait is None else wait)

    def _open_manager(self):
        import orbax.checkpoint as ocp

        if jax.process_index() == 0:
            clean_partial(self.directory)  # temporary dirs; a step without its marker
        if jax.process_count() > 1:  # nobody lists steps while process 0 deletes
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("kdist_checkpoint_clean")
        self._manager = ocp.CheckpointManager(
            self.directory, item_handlers=writer.pytree_handler(),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=self.keep, keep_period=self.keep_every,
                enable_async_checkpointing=True,  # sync saves wait right after save()
                async_options=ocp.AsyncOptions(post_finalization_callback=self._write_metadata),
                create=True,
            ),
        )

    def _save(self, loss, wait: bool):
        if self._saved_step == self.step:
            return
        loss = None if loss is None else float(loss)
        if hasattr(self._fit_model, "jax_state_sync"):
            self._fit_model.jax_state_sync()  # the live state back into the variables (JAX)
        if (loss is not None and not np.isfinite(loss)) or not all_finite(self._variables):
            warnings.warn(f"Checkpoint: not saving step {self.step}: the loss ({loss}) or "
                          f"the weights are not finite. The last good checkpoint "
                          f"(step {self._saved_step}) is kept.", stacklevel=3)
            return
        import orbax.checkpoint as ocp

        start = time.perf_counter()
        try:  # orbax waits minutes (a signal timeout) if it cannot create the step directory
            check_writable_everywhere(self.directory)
        except CheckpointError as e:
            raise save_failed(self.directory, e) from e
        # One save in flight at a time (orbax's save() would wait too): the commit hook
        # then knows which step's metadata it writes. Raises a failed previous save.
        self._wait()
        spe = self._steps_per_epoch
        self._pending = describe(
            self._fit_model, self._variables, self.step,
            None if self._data_base is None else self._data_base + self.step,
            self.step // spe if spe else None, loss)
        tree = {k: v.value for k, v in self._variables.items()}
        try:
            self._manager.save(self.step, args=ocp.args.PyTreeSave(tree), force=True)
        except Exception as e:  # noqa: BLE001 (the previous async save's error lands here)
            raise save_failed(self.directory, e) from e
        self._saved_step = self.step
        self._last_save_time = time.monotonic()
        self._finisher = threading.Thread(target=self._finish, args=(self._manager, self.step),
                                          name=f"kdist-checkpoint-{self.step}", daemon=True)
        self._finisher.start()
        if wait:
            self._wait()
        if self.throughput is not None:
            self.throughput.report_stall(time.perf_counter() - start)

    def _finish(self, manager, step):
        """Background: waits for orbax's commit (the rename), makes it durable, announces."""
        step_dir = self.directory / str(step)
        try:
            manager.wait_until_finished()
            if jax.process_index() == 0:
                fsync_tree(step_dir)
        except BaseException as e:  # noqa: BLE001 (raised on the main thread by _wait)
            self._finish_error = e
            return
        self.committed_step = step
        if self.verbose and jax.process_index() == 0:
            print(f"\nCheckpoint: step {step} committed to {self.directory}", flush=True)
        if self.on_checkpoint is not None:
            self.on_checkpoint(step, step_dir)

    def _wait(self):
        if self._finisher is not None:
            self._finisher.join()
            self._finisher = None
        if self._finish_error is not None:
            e, self._finish_error = self._finish_error, None
            raise save_failed(self.directory, e) from e
        if self._manager is None:
            return
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise save_failed(self.directory, e) from e

    def _close(self):
        if self._manager is not None:
            try:
                self._wait()
            finally:
                manager, self._manager = self._manager, None
                try:
                    manager.close()
                except Exception as e:  # noqa: BLE001
                    raise save_failed(self.directory, e) from e

    def _write_metadata(self):
        """orbax's post-finalization hook (background): arrays written, rename next."""
        if jax.process_index() != 0 or self._pending is None:
            return
        meta, self._pending = self._pending, None
        tmp = [p for p in self.directory.glob(f"{meta['step']}{TMP_MARK}*") if p.is_dir()]
        if len(tmp) != 1:
            raise CheckpointError(f"Expected one temporary directory for step {meta['step']} "
                                  f"in {self.directory}, found {tmp}.")
        write_commit_marker(tmp[0], meta)

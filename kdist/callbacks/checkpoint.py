"""Checkpoints that resume exactly, survive preemption and never lie about a failed save.

``Checkpoint`` is a Keras callback built on orbax-checkpoint's ``CheckpointManager``.

What a step directory holds (``DIR/<step>/``):

* ``default/`` — orbax's array store (OCDBT): every variable of the training state, each
  process writing its own shards. Keys are stable across processes and runs:
  ``params.<path>`` (trainable weights), ``state.<path>`` (other non-trainable weights),
  ``rng.seed_generator_<i>`` (dropout seed-generator states, by order: their Keras names
  depend on how many were created before), ``optimizer.<path>`` (Adam moments,
  ``iteration`` — hence the learning-rate schedule — and gradient accumulators) and
  ``metrics.<path>`` (the running epoch means, so a resumed epoch logs the same loss).
* ``kdist.json`` — small and human-readable: step, data position, loss, model config, mesh,
  versions, wall time, every variable's shape and dtype, and the size of every file of the
  step. It is written by the primary process *inside orbax's temporary directory, after all
  arrays are written and before orbax renames it into place* — so it is the commit marker:
  a step counts only if it is an orbax-final directory that holds ``kdist.json``, and only
  if every file listed there exists with its recorded size.

Why not Keras' ``OrbaxCheckpoint`` / ``BackupAndRestore``: they replay the batches of an
interrupted epoch, number steps by epoch or by batch depending on ``save_freq``, swallow
the failure of the last asynchronous save (keras issue 23609) and delete their backup when
``TerminateOnNaN`` stops training (keras issue 21771). Here:

* **Exact resume.** Training step, data position (the dataset's ``start_step``), optimizer
  state, RNG states and metric accumulators are restored; ``fit`` starts at the right epoch
  (``initial_epoch`` is set for you) and the interrupted epoch runs only its remaining steps.
  Losses and weights are bit-identical to an uninterrupted run on the same mesh.
* **Loud failures.** An asynchronous save that fails raises ``CheckpointError`` from the
  next save or from ``fit`` itself (the final save is waited for before ``fit`` returns);
  a non-finite loss or weight skips the save (and so never rotates a good one out).
* **Preemption.** On SIGTERM or SIGINT during ``fit`` the current step is saved, committed,
  and the process exits with status ``128 + signal`` (a second SIGINT interrupts at once).
* **Resharding.** Arrays are restored straight into the current variables' shardings, so
  a checkpoint saved under ``fsdp=8`` restores under ``model=4`` or on one device.

Multiple processes (``jax.process_count() > 1``): construct the callback identically in
every process with the same (shared-filesystem) directory. Every process writes its own
shards; process 0 (``jax.process_index() == 0``) writes ``kdist.json`` and orbax commits
after a barrier; only process 0 deletes old or partial steps. Decisions that could differ
between processes — a signal arrived, ``save_every_seconds`` elapsed — are agreed with a
host all-gather at every step, so all processes save the same step.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np

METADATA_NAME = "kdist.json"
ITEM_DIR = "default"  # orbax's directory for a single-item checkpoint
TMP_MARK = ".orbax-checkpoint-tmp"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, or no usable checkpoint could be restored."""


# === Naming the training state ===


def state_variables(model: keras.Model) -> dict[str, keras.Variable]:
    """The training state of a compiled model as ``{checkpoint key: variable}``.

    Builds the optimizer first if ``fit`` has not (an unbuilt optimizer has no slots,
    and Keras' ``set_state_tree`` would silently skip them).

    Example:
        >>> from tests.helpers import tiny_gpt
        >>> model = tiny_gpt(); model.compile(optimizer="adamw")
        >>> sorted(state_variables(model))[:2]
        ['metrics.loss.count', 'metrics.loss.total']
    """
    if getattr(model, "optimizer", None) is None:
        raise ValueError(
            "The model is not compiled, so it has no optimizer state to save or restore. "
            "Call model.compile(optimizer=...) before creating the checkpoint state."
        )
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    out: dict[str, keras.Variable] = {}

    def add(key, variable):
        key = key.replace("/", ".")
        if key in out:
            raise ValueError(f"Two variables map to the checkpoint key {key!r}: "
                             f"{out[key].path} and {variable.path}. Give them distinct names.")
        out[key] = variable

    for v in model.trainable_variables:
        add(f"params.{v.path}", v)
    seed = 0
    for v in model.non_trainable_variables:
        if v.path.endswith("seed_generator_state"):
            add(f"rng.seed_generator_{seed}", v)
            seed += 1
        else:
            add(f"state.{v.path}", v)
    for v in model.optimizer.variables:
        add(f"optimizer.{v.path.split('/', 1)[-1]}", v)  # drop "adam_w_1/": build-order name
    for v in model.metrics_variables:
        add(f"metrics.{v.path}", v)
    return out


_all_finite = jax.jit(lambda xs: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs])))


def _finite(variables: dict[str, keras.Variable]) -> bool:
    # The weights only: a third of the state (the Adam moments are 2x its size), and a
    # non-finite moment makes the weights non-finite at the next update anyway.
    floats = [v.value for k, v in variables.items()
              if k.startswith("params.") and jnp.issubdtype(v.value.dtype, jnp.floating)]
    return bool(_all_finite(floats)) if floats else True


# === Reading a checkpoint directory ===


def _step_dirs(directory: Path) -> tuple[dict[int, Path], list[Path]]:
    """Final step directories by step, and partial (temporary) ones."""
    final, partial = {}, []
    if not directory.is_dir():
        return final, partial
    for p in directory.iterdir():
        if not p.is_dir():
            continue
        if TMP_MARK in p.name:
            partial.append(p)
        elif p.name.isdigit():
            final[int(p.name)] = p
    return dict(sorted(final.items())), partial


def read_metadata(step_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``kdist.json`` of a step directory (raises ``CheckpointError`` naming the file).

    Example:
        >>> read_metadata("runs/gpt/checkpoints/200")["step"]  # doctest: +SKIP
        200
    """
    path = Path(step_dir) / METADATA_NAME
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} is missing: step {Path(step_dir).name} was never "
                              f"committed (interrupted save).") from e
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is unreadable: {e}") from e


def verify_step(step_dir: str | os.PathLike) -> list[str]:
    """Integrity problems of a step directory (empty list: intact), each naming a file.

    Checks that the commit marker ``kdist.json`` exists and that every file it lists is
    present with its recorded size (a truncated or missing array file fails).

    Example:
        >>> verify_step("runs/gpt/checkpoints/200")  # doctest: +SKIP
        []
    """
    step_dir = Path(step_dir)
    try:
        meta = read_metadata(step_dir)
    except CheckpointError as e:
        return [str(e)]
    problems = []
    for rel, size in meta.get("files", {}).items():
        f = step_dir / rel
        if not f.is_file():
            problems.append(f"{f} is missing")
        elif f.stat().st_size != size:
            problems.append(f"{f} has {f.stat().st_size} bytes, {size} were written "
                            f"(truncated or overwritten)")
    if not meta.get("files"):
        problems.append(f"{step_dir / METADATA_NAME} lists no files")
    return problems


def committed_steps(directory: str | os.PathLike) -> list[int]:
    """Steps with a commit marker, oldest first (integrity not checked; see verify_step).

    Example:
        >>> committed_steps("/nonexistent")
        []
    """
    final, _ = _step_dirs(Path(directory))
    return [s for s, p in final.items() if (p / METADATA_NAME).is_file()]


def _listing(directory: Path) -> str:
    if not directory.is_dir():
        return "no such directory"
    return str(sorted(p.name for p in directory.iterdir())) or "empty"


def _file_sizes(root: Path) -> dict[str, int]:
    # The array store only: orbax rewrites its step-level _CHECKPOINT_METADATA at commit.
    return {str(f.relative_to(root)): f.stat().st_size
            for f in sorted((root / ITEM_DIR).rglob("*")) if f.is_file()}


def _jsonable(x):
    try:
        json.dumps(x)
        return x
    except TypeError:
        return json.loads(json.dumps(x, default=str))


def _versions() -> dict[str, str]:
    import orbax.checkpoint as ocp

    import kdist
    return {"kdist": kdist.__version__, "keras": keras.__version__, "jax": jax.__version__,
            "orbax-checkpoint": getattr(ocp, "__version__", "?")}


def _mesh_description() -> dict[str, Any]:
    dist = keras.distribution.distribution()
    if dist is None:
        return {"spec": None, "shape": {}, "devices": 1}
    mesh = dist.device_mesh
    return {"spec": getattr(dist, "spec", type(dist).__name__),
            "shape": dict(zip(mesh.axis_names, (int(s) for s in mesh.shape))),
            "devices": int(np.prod(mesh.shape))}


# === The callback ===


class Checkpoint(keras.callbacks.Callback):
    """Asynchronous, atomic, exactly-resuming checkpoints of a ``model.fit`` run.

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
        throughput: a ``kdist.callbacks.Throughput`` to report blocking waits to.
        verbose: print one line per restore and per committed save.

    Example:
        >>> ckpt = Checkpoint("runs/gpt/ckpt", save_every_steps=100,
        ...                   data=data.train)  # doctest: +SKIP
        >>> model.fit(data.train, epochs=10, steps_per_epoch=50,
        ...           callbacks=[ckpt])  # doctest: +SKIP

    ``fit`` then resumes by itself: run the same script again and it continues from the
    newest committed step. To know the step before ``fit`` (e.g. to size the data), call
    ``ckpt.restore(model)`` first; ``fit`` then does not restore again.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        save_every_steps: int | None = None,
        save_every_seconds: float | None = None,
        keep: int = 3,
        keep_every: int | None = None,
        data: Any = None,
        resume: str = "auto",
        init_from: str | os.PathLike | None = None,
        async_save: bool = True,
        handle_signals: bool = True,
        exit_on_signal: bool = True,
        throughput: Any = None,
        verbose: bool = True,
    ):
        super().__init__()
        for name, value in (("save_every_steps", save_every_steps), ("keep_every", keep_every)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None; got {value!r}.")
        if save_every_seconds is not None and not save_every_seconds > 0:
            raise ValueError(f"save_every_seconds must be positive or None; "
                             f"got {save_every_seconds!r}.")
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
        self.save_every_steps = save_every_steps
        self.save_every_seconds = save_every_seconds
        self.keep = keep
        self.keep_every = keep_every
        self.data = data
        self.resume = resume
        self.init_from = init_from
        self.async_save = async_save
        self.handle_signals = handle_signals
        self.exit_on_signal = exit_on_signal
        self.throughput = throughput
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
        self.interrupted_by = None
        self._manager = None
        self._pending: dict[str, Any] | None = None
        self._saved_step = None
        self._restored_metrics: dict[str, np.ndarray] = {}
        self._signal = None
        self._old_handlers: dict[int, Any] = {}

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
        the newest is incomplete or corrupt (unless ``step`` was asked for explicitly,
        which then fails). With no step to resume, applies ``init_from`` if set (weights
        only) and returns 0. Sets the dataset's ``start_step`` (``data=``). Returns the
        training step to continue from.

        Example:
            >>> step = Checkpoint("runs/gpt/ckpt").restore(model)  # doctest: +SKIP
        """
        model = model if model is not None else self._model
        variables = state_variables(model)
        candidates = committed_steps(self.directory)
        if step is not None:
            if step not in candidates:
                raise CheckpointError(f"Step {step} is not a committed checkpoint in "
                                      f"{self.directory}; committed: {candidates}.")
            candidates = [step]
        if not candidates:
            if self.resume == "required":
                raise CheckpointError(
                    f"resume='required' but {self.directory} holds no committed checkpoint "
                    f"(found: {_listing(self.directory)}). Check the path, or drop --resume "
                    f"to start a new run."
                )
            self.restored_step = 0
            if self.init_from is not None:
                self._init_weights(model, variables)
            return 0
        failures = []
        for s in reversed(candidates):
            step_dir = self.directory / str(s)
            problems = verify_step(step_dir)
            if not problems:
                meta = read_metadata(step_dir)
                # An incompatible model is the user's to fix, not a reason to fall back.
                _check_compatible(meta, variables, step_dir)
                try:
                    values = _read_arrays(step_dir, variables, keys=list(variables))
                except Exception as e:  # noqa: BLE001 (TensorStore raises ValueError, ...)
                    problems = [f"{step_dir}: reading the arrays failed: {e}"]
            if problems:
                failures.append(f"step {s}: " + "; ".join(problems))
                if step is not None:
                    raise CheckpointError(f"Checkpoint step {s} is damaged: "
                                          + "; ".join(problems))
                warnings.warn(f"Checkpoint step {s} is damaged, trying an older one: "
                              + "; ".join(problems), stacklevel=2)
                continue
            break
        else:
            raise CheckpointError(f"No intact checkpoint in {self.directory}: "
                                  + " | ".join(failures)
                                  + ". Delete the damaged step directories to start over.")
        for key, v in variables.items():
            v.assign(values[key])
        self._restored_metrics = {k: values[k] for k in variables if k.startswith("metrics.")}
        self.step = self.restored_step = int(meta["step"])
        self.data_step = int(meta.get("data_step", meta["step"]))
        self._saved_step = self.step
        self._position_data()
        if self.verbose:
            print(f"Checkpoint: resumed from {step_dir} (step {self.step}, data position "
                  f"{self.data_step}, loss {meta.get('loss')})")
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

    def _init_weights(self, model, variables):
        source = Path(self.init_from)
        if source.is_file():
            with warnings.catch_warnings():  # weights only, by design: no optimizer state
                warnings.filterwarnings("ignore", "Skipping variable loading for optimizer")
                model.load_weights(str(source))
        else:
            if source.is_dir() and not (source / METADATA_NAME).is_file():
                steps = committed_steps(source)
                if not steps:
                    raise CheckpointError(f"init_from={source} holds no committed checkpoint.")
                source = source / str(steps[-1])
            problems = verify_step(source)
            if problems:
                raise CheckpointError(f"init_from={source} is damaged: " + "; ".join(problems))
            keys = [k for k in variables if k.startswith(("params.", "state."))]
            _check_compatible(read_metadata(source), variables, source, keys)
            values = _read_arrays(source, variables, keys)
            for k in keys:
                variables[k].assign(values[k])
        if self.verbose:
            print(f"Checkpoint: initialised weights from {source} (optimizer and step fresh)")

    # --- fit hooks ---

    def on_train_begin(self, logs=None):
        model = self._model
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
        self._variables = state_variables(model)
        self._steps_per_epoch = self.params.get("steps") if self.params else None
        if self.restored_step and self._steps_per_epoch and not getattr(self, "_trained", False):
            model._initial_epoch = self.step // self._steps_per_epoch  # fit starts there
        # Only the first fit after a restore can start inside an epoch.
        self._first_epoch = bool(self.restored_step) and not getattr(self, "_trained", False)
        self._signal = self.interrupted_by = None
        self._last_save_time = time.monotonic()
        self._open_manager()
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def on_epoch_begin(self, epoch, logs=None):
        self._batch_base = self.step  # Keras numbers batches from 0 in every epoch
        self._stop_after = None
        if self._first_epoch and self._steps_per_epoch:
            done = self.step - epoch * self._steps_per_epoch
            if 0 < done < self._steps_per_epoch:
                # Resumed mid-epoch: continue its running means, run only the rest of it.
                for key, value in self._restored_metrics.items():
                    self._variables[key].assign(value)
                self._stop_after = self._steps_per_epoch - done
        self._first_epoch = False

    def on_train_batch_end(self, batch, logs=None):
        self.step = self._batch_base + batch + 1
        due = bool(self.save_every_steps and self.step % self.save_every_steps == 0)
        if self.save_every_seconds:
            due |= time.monotonic() - self._last_save_time >= self.save_every_seconds
        interrupted = self._signal is not None
        if jax.process_count() > 1 and (self.save_every_seconds or self.handle_signals):
            from jax.experimental import multihost_utils

            flags = multihost_utils.process_allgather(np.array([due, interrupted], np.int32))
            due, interrupted = bool(flags[..., 0].any()), bool(flags[..., 1].any())
        loss = (logs or {}).get("loss")
        if interrupted:
            self.interrupted_by = self._signal or signal.SIGTERM
            self._save(loss, wait=True)
            self._model.stop_training = True
        elif due:
            self._save(loss, wait=not self.async_save)
        if self._stop_after is not None and batch + 1 >= self._stop_after:
            # The resumed epoch is complete: end it here; on_epoch_end lets fit go on.
            self._model.stop_training = True
            self._ending_partial_epoch = not interrupted

    def on_epoch_end(self, epoch, logs=None):
        if getattr(self, "_ending_partial_epoch", False):
            self._ending_partial_epoch = False
            if self.interrupted_by is None:
                _end_keras_epoch()
                self._model.stop_training = False

    def on_train_end(self, logs=None):
        try:
            if self._saved_step != self.step:
                self._save((logs or {}).get("loss"), wait=True)
            self._wait()
        finally:
            self._trained = True
            self._close()
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
            self._old_handlers = {}
            self._model._initial_epoch = None
        if self.interrupted_by is not None and self.exit_on_signal:
            name = signal.Signals(self.interrupted_by).name
            print(f"Checkpoint: {name} received; step {self.step} is committed in "
                  f"{self.directory}. Exiting.", flush=True)
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
            self._clean_partial()
        if jax.process_count() > 1:  # nobody lists steps while process 0 deletes
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("kdist_checkpoint_clean")
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=self.keep,
                keep_period=self.keep_every,
                enable_async_checkpointing=True,  # sync saves wait right after save()
                async_options=ocp.AsyncOptions(post_finalization_callback=self._write_metadata),
                create=True,
            ),
        )

    def _clean_partial(self):
        """Removes what an interrupted save left: temporary dirs, uncommitted step dirs."""
        final, partial = _step_dirs(self.directory)
        stale = partial + [p for p in final.values() if not (p / METADATA_NAME).is_file()]
        for p in stale:
            warnings.warn(f"Checkpoint: removing {p}, left by an interrupted save.",
                          stacklevel=3)
            shutil.rmtree(p, ignore_errors=True)

    def _save(self, loss, wait: bool):
        if self._saved_step == self.step:
            return
        loss = None if loss is None else float(loss)
        if hasattr(self._model, "jax_state_sync"):
            self._model.jax_state_sync()  # the live state back into the variables (JAX)
        if (loss is not None and not np.isfinite(loss)) or not _finite(self._variables):
            warnings.warn(f"Checkpoint: not saving step {self.step}: the loss ({loss}) or "
                          f"the weights are not finite. The last good checkpoint "
                          f"(step {self._saved_step}) is kept.", stacklevel=3)
            return
        import orbax.checkpoint as ocp

        start = time.perf_counter()
        # One save in flight at a time (orbax's save() would wait too): the commit hook
        # then knows which step's metadata it writes. Raises a failed previous save.
        self._wait()
        self._pending = self._metadata(loss)
        tree = {k: v.value for k, v in self._variables.items()}
        try:
            self._manager.save(self.step, args=ocp.args.StandardSave(tree), force=True)
        except Exception as e:  # noqa: BLE001 (the previous async save's error lands here)
            raise self._error(e) from e
        self._saved_step = self.step
        self._last_save_time = time.monotonic()
        if wait:
            self._wait()
        if self.throughput is not None:
            self.throughput.report_stall(time.perf_counter() - start)

    def _wait(self):
        if self._manager is None:
            return
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._error(e) from e

    def _error(self, e: Exception) -> CheckpointError:
        previous = [s for s in committed_steps(self.directory)]
        disk_full = (isinstance(e, OSError) and e.errno == errno.ENOSPC) or \
            "RESOURCE_EXHAUSTED" in str(e) or "No space left" in str(e)
        return CheckpointError(
            f"Saving a checkpoint to {self.directory} failed"
            f"{' (disk full)' if disk_full else ''}: {type(e).__name__}: {e}. Committed steps "
            f"still there: {previous}. Free space or fix the directory, then rerun: training "
            f"resumes from step {previous[-1] if previous else 0}."
        )

    def _close(self):
        if self._manager is not None:
            manager, self._manager = self._manager, None
            try:
                manager.close()
            except Exception as e:  # noqa: BLE001
                raise self._error(e) from e

    def _metadata(self, loss) -> dict[str, Any]:
        model = self._model
        try:
            config = keras.saving.serialize_keras_object(model)
        except Exception as e:  # noqa: BLE001 (a model without get_config still saves)
            config = {"error": f"get_config failed: {e}"}
        return {
            "step": self.step,
            "data_step": None if self._data_base is None else self._data_base + self.step,
            "epoch": self.step // self._steps_per_epoch if self._steps_per_epoch else None,
            "loss": loss,
            "wall_time": time.time(),
            "wall_time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "mesh": _mesh_description(),
            "process_count": jax.process_count(),
            "versions": _versions(),
            "model_config": _jsonable(config),
            "variables": {k: {"path": v.path, "shape": list(v.shape), "dtype": str(v.dtype)}
                          for k, v in self._variables.items()},
        }

    def _write_metadata(self):
        """orbax's post-finalization hook: all arrays are written, the rename is next."""
        if jax.process_index() != 0 or self._pending is None:
            return
        meta, self._pending = self._pending, None
        tmp = [p for p in self.directory.glob(f"{meta['step']}{TMP_MARK}*") if p.is_dir()]
        if len(tmp) != 1:
            raise CheckpointError(f"Expected one temporary directory for step {meta['step']} "
                                  f"in {self.directory}, found {tmp}.")
        meta["files"] = _file_sizes(tmp[0])
        path = tmp[0] / METADATA_NAME
        path.write_text(json.dumps(meta, indent=1), encoding="utf-8")
        if self.verbose:
            print(f"\nCheckpoint: step {meta['step']} committed to {self.directory}", flush=True)


def _end_keras_epoch():
    """Tells fit's data adapter that the (resumed, shortened) epoch is over.

    An epoch that ends by ``stop_training`` leaves Keras' epoch iterator suspended before
    its ``data_adapter.on_epoch_end()``, and a ``PyDataset`` adapter then refuses the next
    epoch ("on_epoch_begin was called twice"). Keras offers callbacks no handle on the
    iterator, so it is found in ``fit``'s frame, which is on the stack of on_epoch_end.
    """
    frame = sys._getframe(1)
    while frame is not None:
        iterator = frame.f_locals.get("epoch_iterator")
        if iterator is not None and hasattr(iterator, "data_adapter"):
            iterator.data_adapter.on_epoch_end()
            return
        frame = frame.f_back
    raise CheckpointError(
        "Could not find Keras' epoch iterator to end the resumed epoch early (a Keras "
        "version whose fit differs from 3.15's?). Resume from a step at an epoch boundary "
        "(save_every_steps a multiple of steps_per_epoch) to avoid this."
    )


def _check_compatible(meta, variables, step_dir, keys=None):
    """ValueError naming every variable whose shape differs, is missing or is extra."""
    saved = meta.get("variables", {})
    problems = []
    for key in keys or variables:
        v = variables[key]
        if key not in saved:
            problems.append(f"{v.path} (shape {tuple(v.shape)}) is not in the checkpoint")
        elif tuple(saved[key]["shape"]) != tuple(v.shape):
            problems.append(f"{v.path}: checkpoint shape {tuple(saved[key]['shape'])}, "
                            f"model shape {tuple(v.shape)}")
    extra = [saved[k]["path"] for k in saved if k not in variables
             and (keys is None or k.split(".")[0] in {x.split(".")[0] for x in keys})]
    if extra:
        problems.append(f"the checkpoint has variables the model lacks: {extra[:5]}"
                        f"{' ...' if len(extra) > 5 else ''}")
    if problems:
        raise ValueError(
            f"The checkpoint {step_dir} does not fit this model: " + "; ".join(problems[:8])
            + ("; ..." if len(problems) > 8 else "")
            + ". Build the model with the checkpoint's preset/config (see 'kdist inspect "
            f"{Path(step_dir).parent}'), or use another checkpoint directory."
        )


def _read_arrays(step_dir, variables, keys):
    """The arrays of ``keys``, placed in the current variables' shardings (resharding)."""

    def target(v):
        value = v.value
        sharding = getattr(value, "sharding", None)
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)

    saved = read_metadata(step_dir)["variables"]
    return _restore_tree(step_dir, {k: target(variables[k]) for k in saved if k in keys})


def _restore_tree(step_dir, tree):
    """Reads the arrays named in ``tree`` (``ShapeDtypeStruct`` leaves with shardings)."""
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as checkpointer:
        return checkpointer.restore(Path(step_dir) / ITEM_DIR, args=ocp.args.PyTreeRestore(
            tree, restore_args=ocp.checkpoint_utils.construct_restore_args(tree),
            partial_restore=True))


# === kdist inspect ===


def inspect_directory(directory: str | os.PathLike, read_arrays: bool = False) -> tuple[str, bool]:
    """A report on a checkpoint directory: steps, sizes, config, integrity. Returns
    ``(text, ok)``; ``ok`` is False when a committed step is damaged.

    With ``read_arrays``, every array of every step is read back (onto one device).

    Example:
        >>> text, ok = inspect_directory("runs/gpt_pretrain/checkpoints")  # doctest: +SKIP
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory. Pass a checkpoint directory "
                         f"(the recipes' --checkpoint-dir, default OUTPUT_DIR/checkpoints).")
    final, partial = _step_dirs(directory)
    lines, ok, newest = [f"checkpoint directory {directory}"], True, None
    if not final and not partial:
        lines.append("no checkpoints")
        return "\n".join(lines), True
    lines.append(f"{'step':>8}  {'size':>10}  {'loss':>9}  {'saved (UTC)':20}  status")
    for s, p in final.items():
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        problems = verify_step(p)
        meta = {}
        if (p / METADATA_NAME).is_file():
            try:
                meta = read_metadata(p)
            except CheckpointError:
                pass
        if not problems and read_arrays:
            problems = _read_check(p, meta)
        status = "ok" if not problems else "DAMAGED: " + "; ".join(problems)
        ok &= not problems
        if not problems:
            newest = meta
        loss = meta.get("loss")
        lines.append(f"{s:>8}  {size / 2**20:>8.1f}MB  "
                     f"{'' if loss is None else f'{loss:.4f}':>9}  "
                     f"{meta.get('wall_time_utc', ''):20}  {status}")
    for p in partial:
        lines.append(f"{'':>8}  partial save {p.name} (ignored; removed on the next run)")
    if newest:
        config = newest.get("model_config", {})
        inner = config.get("config", {}) if isinstance(config, dict) else {}
        backbone = inner.get("backbone", {}).get("config", inner) if isinstance(inner, dict) else {}
        lines.append(f"newest intact: step {newest['step']}, data position "
                     f"{newest.get('data_step')}, mesh {newest.get('mesh', {}).get('spec')} "
                     f"{newest.get('mesh', {}).get('shape')}, {newest.get('process_count')} "
                     f"process(es), versions {newest.get('versions')}")
        lines.append(f"model: {config.get('class_name', '?') if isinstance(config, dict) else '?'} "
                     + json.dumps({k: v for k, v in backbone.items()
                                   if isinstance(v, (int, float, str, bool))}))
        n = sum(int(np.prod(v["shape"])) for k, v in newest.get("variables", {}).items()
                if k.startswith("params."))
        lines.append(f"parameters: {n:,}")
    return "\n".join(lines), ok


def _read_check(step_dir, meta) -> list[str]:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tree = {k: jax.ShapeDtypeStruct(tuple(v["shape"]), jnp.dtype(v["dtype"]), sharding=device)
            for k, v in meta["variables"].items()}
    try:
        _restore_tree(step_dir, tree)
    except Exception as e:  # noqa: BLE001
        return [f"reading the arrays of {step_dir} failed: {e}"]
    return []

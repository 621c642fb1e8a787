"""The script the multi-process tests run, once per rank, under ``kdist.launch``.

    python -m kdist.launch --processes 2 --devices-per-process 4 \\
        tests/multihost_script.py train --mesh fsdp=8 --steps 3 --out DIR

Each command joins the cluster with ``kdist.initialize()`` (a no-op in one process), sets the
mesh, and writes what it saw to ``DIR/<command>-rank<process index>.json``, which the test
compares with a one-process run of the same function (called in the test's own process).
A new multi-process scenario is one more function registered in ``COMMANDS``, taking the
parsed arguments and returning a JSON-able dict; it can reuse :func:`setup`, :func:`tiny_model`
and :func:`tiny_data`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import kdist  # kdist.launch gave this process its host devices (kdist.force_host_devices)

# isort: split
import jax
import keras
import numpy as np

# A GPT small enough to compile in seconds, every dimension divisible by 8 (as tests/helpers).
TINY_GPT = dict(num_layers=2, num_heads=8, hidden_dim=64, intermediate_dim=128,
                max_sequence_length=32)
SEQUENCE_LENGTH = 16
GLOBAL_BATCH_SIZE = 8
# The groups case's validation loss, before and after fit: its first 16 of the corpus' 100
# validation batches (2,048 tokens). The groups' claims compare it between runs of the same
# code or ask it to fall by 0.1; the whole split cost each group process ~4 CPU-s of
# evaluation in a 3-step job.
VALIDATION_BATCHES = 16
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400))


def setup(mesh: str, sync_every: int | None = None) -> kdist.multihost.ProcessInfo:
    """Joins the cluster (if launched as one), then sets the mesh (DiLoCo's replica groups
    with ``sync_every``) and float32."""
    info = kdist.initialize(timeout=60)
    keras.distribution.set_distribution(kdist.distribution(mesh, sync_every=sync_every))
    keras.config.set_dtype_policy("float32")
    return info


def tiny_data(corpus_dir: Path | None = None, cache_dir: Path | None = None,
              prefetch: int = 2) -> kdist.data.LMData:
    """A small local corpus through the full data path (tokenizer, token store, shares).

    By default corpus and cache are one folder shared by every run and test
    (``$KDIST_CACHE/multihost-script``): the first process trains the vocabulary and writes
    the token stores, every later one (a rank, a group, a relaunch, the next test) finds
    them cached and never imports keras-hub (~1 CPU-s a process here, where TensorFlow is
    blocked: see the end of this file; ~3 with it). Every rank builds it concurrently into
    the same cache: the token store is written once.
    The corpus files are written only when absent or different, and atomically: rewriting
    them in place let a rank read a half-written file (another vocabulary: a crash in the
    first collective) and changed their mtimes, which key the token store.
    """
    from kdist.data.tokenizer import cache_root

    shared = cache_root() / "multihost-script"
    corpus_dir, cache_dir = corpus_dir or shared / "corpus", cache_dir or shared / "cache"
    corpus_dir.mkdir(parents=True, exist_ok=True)
    for k in range(4):
        path, text = corpus_dir / f"doc{k}.py", TEXT[k::4] if k else TEXT
        if not path.is_file() or path.read_text() != text:
            tmp = corpus_dir.parent / f".{path.name}.{os.getpid()}"  # not in the corpus
            tmp.write_text(text)
            os.replace(tmp, path)
    return kdist.data.lm_dataset(
        str(corpus_dir), sequence_length=SEQUENCE_LENGTH, global_batch_size=GLOBAL_BATCH_SIZE,
        vocabulary_size=320, cache_dir=cache_dir, prefetch=prefetch,
    )


def tiny_model(vocabulary_size: int, seed: int = 0) -> kdist.models.GPTCausalLM:
    keras.utils.set_random_seed(seed)  # same initial weights in every process and run
    return kdist.models.GPTCausalLM(
        kdist.models.GPTBackbone(vocabulary_size=vocabulary_size, **TINY_GPT)
    )


def train(args) -> dict:
    """``fit`` for ``--steps`` one-step epochs; per-step losses and the rows each step used."""
    info = setup(args.mesh, getattr(args, "sync_every", None))
    data = tiny_data()
    served: dict[int, list] = {}

    class Recording(type(data.train)):  # notes the rows this process actually served
        def __getitem__(self, index):
            inputs, targets = super().__getitem__(index)
            served[int(index)] = inputs.tolist()
            return inputs, targets

    data.train.__class__ = Recording
    model = tiny_model(data.vocabulary_size)
    # The parity optimizer of tests/helpers.py (why epsilon=1e-3: see parity_optimizer).
    model.compile(optimizer=kdist.optim.adamw(1e-2, warmup_steps=1, decay_steps=10,
                                              epsilon=1e-3))
    # One step per epoch, so each epoch's loss is exactly that step's loss.
    history = model.fit(data.train, epochs=args.steps, steps_per_epoch=1, shuffle=False,
                        verbose=0)
    return dict(
        process_index=info.process_index, process_count=info.process_count,
        devices=jax.device_count(), local_devices=jax.local_device_count(),
        mesh=keras.distribution.distribution().spec,
        losses=[float(v) for v in history.history["loss"]],
        rows={str(k): v for k, v in sorted(served.items()) if k < args.steps},
        windows={str(k): data.train.windows(k).tolist() for k in range(args.steps)},
    )


def wordpiece(args) -> dict:
    """A WordPiece vocabulary trained on the tiny corpus, each rank with its own cache (as on
    hosts without a shared disk); rank 1's cache already holds a stale, different one."""
    setup(args.mesh)
    corpus_dir = Path(args.out) / "corpus"
    tiny_data(corpus_dir, Path(args.out) / "lm-cache")  # writes the corpus files
    corpus = kdist.data.load_corpus(str(corpus_dir))
    cache = Path(args.out) / f"wordpiece-cache-rank{jax.process_index()}"
    stale = cache / f"wordpiece-{corpus.fingerprint}-320" / "vocabulary.txt"
    if jax.process_index() == 1:
        stale.parent.mkdir(parents=True, exist_ok=True)
        stale.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "stale"]))
    tokenizer = kdist.data.word_piece_tokenizer(corpus, 320, cache_dir=cache)
    return dict(vocabulary=tokenizer.get_vocabulary(), cached=stale.read_text().splitlines())


def hang(args) -> dict:
    """Joins the cluster, says "ready", then runs cross-process barriers until killed."""
    from jax.experimental import multihost_utils

    info = setup(args.mesh)
    multihost_utils.sync_global_devices("start")
    print(f"rank {info.process_index} ready", flush=True)
    for beat in range(10_000):
        multihost_utils.sync_global_devices(f"beat{beat}")
        time.sleep(0.2)
    return {}


def gather_state(model) -> dict[str, np.ndarray]:
    """Every checkpointed variable as a whole numpy array, gathered from all processes."""
    from jax.experimental import multihost_utils

    from kdist.callbacks.checkpoint import state_variables

    return {k: np.asarray(multihost_utils.process_allgather(v.value, tiled=True))
            for k, v in state_variables(model).items()}


class PrintLoss(keras.callbacks.Callback):
    """Prints each step's loss exactly (``repr``), so a run that is killed still told it."""

    def on_epoch_end(self, epoch, logs=None):  # one-step epochs: epoch e is step e + 1
        print(f"step {epoch + 1} loss {float(logs['loss'])!r}", flush=True)


def ckpt(args) -> dict:
    """``train`` with a ``kdist.callbacks.Checkpoint`` in ``--ckpt`` (resuming from it).

    Writes the state just restored and the final state, gathered, to
    ``OUT/<tag>-restored.npz`` and ``OUT/<tag>-final.npz`` (process 0). With ``--hang-at S``,
    process 0 stalls inside step S's commit (arrays written, no commit marker) and prints
    "hanging in the commit of step S" — once: a marker file makes the relaunch run normally.
    """
    from kdist.callbacks import Checkpoint

    keras.utils.clear_session()  # variable paths (checkpoint keys) depend on build order
    info = setup(args.mesh)
    out = Path(args.out)
    data = tiny_data()
    model = tiny_model(data.vocabulary_size)
    model.compile(optimizer=kdist.optim.adamw(1e-2, warmup_steps=1, decay_steps=10,
                                              epsilon=1e-3))
    checkpoint = Checkpoint(args.ckpt, save_every_steps=args.save_every, data=data.train)
    marker = Path(args.ckpt).parent / f"hung-{Path(args.ckpt).name}"
    if args.hang_at and info.process_index == 0 and not marker.exists():
        write = checkpoint._write_metadata

        def hang_in_commit():
            if checkpoint._pending and checkpoint._pending["step"] == args.hang_at:
                marker.touch()
                print(f"hanging in the commit of step {args.hang_at}", flush=True)
                time.sleep(600)  # the test kills the job here
            write()

        checkpoint._write_metadata = hang_in_commit  # orbax's commit hook, bound at fit
    restored = checkpoint.restore(model)
    state = gather_state(model)
    if info.process_index == 0:
        np.savez(out / f"{args.tag}-restored.npz", **state)
    history = model.fit(data.train, epochs=args.steps, steps_per_epoch=1, shuffle=False,
                        verbose=0, callbacks=[PrintLoss(), checkpoint])
    state = gather_state(model)
    if info.process_index == 0:
        np.savez(out / f"{args.tag}-final.npz", **state)
    return dict(
        process_index=info.process_index, process_count=info.process_count,
        devices=jax.device_count(), restored_step=restored, step=checkpoint.step,
        losses={str(e + 1): float(v) for e, v in zip(history.epoch, history.history["loss"])},
    )


def devices(args) -> dict:
    """Where this process's devices sit in the mesh: ``{axis: sorted coordinates}``."""
    info = setup(args.mesh)
    mesh = keras.distribution.distribution().device_mesh
    local = {d.id for d in jax.local_devices()}
    coords = {axis: set() for axis in mesh.axis_names}
    for index, device in np.ndenumerate(mesh.backend_mesh.devices):
        if device.id in local:
            for axis, i in zip(mesh.axis_names, index):
                coords[axis].add(int(i))
    return dict(process_index=info.process_index,
                coords={axis: sorted(c) for axis, c in coords.items()})


def stragglers(args) -> dict:
    """``fit`` with a ``Throughput`` callback where process ``--slow-rank``'s loader takes
    ``--slow-seconds`` longer per batch: a slow input pipeline, simulated (nothing waits
    on the delay; the other processes wait for this one in every step's collectives)."""
    from kdist.callbacks import Throughput
    from kdist.callbacks.stragglers import Stragglers

    info = setup(args.mesh)
    # Batches prepared in line (no prefetch threads): the slow loader's time is the wait.
    data = tiny_data(prefetch=1)

    class Slow(type(data.train)):
        def __getitem__(self, index):
            if info.process_index == args.slow_rank:
                time.sleep(args.slow_seconds)  # the simulated slow loader
            return super().__getitem__(index)

    data.train.__class__ = Slow
    model = tiny_model(data.vocabulary_size)
    # train's optimizer: the same step program, so it is loaded from the compilation cache
    # the "train fsdp=8" case filled rather than compiled again (~4 CPU-s a process).
    model.compile(optimizer=kdist.optim.adamw(1e-2, warmup_steps=1, decay_steps=10,
                                              epsilon=1e-3))
    throughput = Throughput(GLOBAL_BATCH_SIZE, SEQUENCE_LENGTH, log_dir=Path(args.out) / "run",
                            log_every=2, tensorboard=False, progress_bar=False,
                            stragglers=Stragglers(threshold=0.1, patience=2))
    model.fit(data.train, epochs=1, steps_per_epoch=args.steps, shuffle=False, verbose=0,
              callbacks=[throughput])
    return dict(process_index=info.process_index,
                input_wait_s=[r.get("input_wait_s") for r in throughput.rows
                              if r["kind"] == "interval"])


def hf(args) -> dict:
    """Loads the Hugging Face checkpoint in ``--source`` under the mesh (stacked with
    ``--scan-layers``), counting the bytes this process reads from the files; checks each
    local shard against the stored tensor; exports to ``OUT/export`` (every process joins
    the gathers, process 0 writes)."""
    import contextlib

    from safetensors.numpy import load_file

    from kdist.models.hf import checkpoint, stacked

    info = setup(args.mesh)
    read = {"bytes": 0, "tensors": {}}
    original = checkpoint.HFCheckpoint.opened

    @contextlib.contextmanager
    def counting(self, name):  # every box this process copies out of the files
        with original(self, name) as reader:
            def read_box(box):
                values = reader(box)
                read["bytes"] += values.nbytes
                read["tensors"][name] = read["tensors"].get(name, 0) + values.nbytes
                return values
            yield read_box

    checkpoint.HFCheckpoint.opened = counting
    try:
        lm = kdist.models.GPTCausalLM.from_pretrained(args.source, scan_layers=args.scan_layers)
    finally:
        checkpoint.HFCheckpoint.opened = original
    stored = load_file(str(Path(args.source) / "model.safetensors"))
    worst = 0.0
    for weight in lm.weights:  # local shards against the stored tensors, exactly
        tensor_map = stacked.fitted(
            kdist.models.hf.gpt2.tensor_map(weight.path, lm.backbone.get_config()), weight.shape)
        full = tensor_map.read(lambda key, box: stored[key][box])
        for shard in weight.value.addressable_shards:
            worst = max(worst, float(np.abs(np.asarray(shard.data) - full[shard.index]).max()))
    kdist.hf.export(lm, Path(args.out) / "export")
    return {"process_index": info.process_index, "local_devices": info.local_device_count,
            "bytes_read": read["bytes"], "tensors_read": read["tensors"],
            "checkpoint_bytes": sum(v.nbytes for v in stored.values()),
            "worst_shard_error": worst}


def groups(args) -> dict:
    """DiLoCo on ``--mesh`` (``replica=G,...``, ``--sync-every H``) for ``--steps`` one-step
    epochs — in one program, or as one of G separate group jobs (``python -m kdist.launch
    --replica-groups G``: the same call). Prints each step's loss; with ``--ckpt`` keeps a
    checkpoint per group (``CKPT/group-<g>``) and resumes from it; ``--step-sleep`` per
    batch stretches the run for fault trials. Writes the final weights to
    ``OUT/<tag>-g<group>.npz``, its throughput log to ``OUT/<tag>-run-g<group>/``, and
    returns the losses and the validation loss before and after ``fit``."""
    from kdist.callbacks import Checkpoint, Throughput

    info = setup(args.mesh, args.sync_every)
    job = kdist.groups.from_environment()  # None in one program
    group, groups = (job.index, job.count) if job else (0, 1)
    if group == args.late_group:  # a group that starts late (a slow machine, a queue)
        time.sleep(args.late_seconds)
    out = Path(args.out)
    data = tiny_data()
    model = tiny_model(data.vocabulary_size)
    model.compile(optimizer=kdist.optim.adamw(args.learning_rate, warmup_steps=1,
                                              decay_steps=10, epsilon=1e-3))

    class Slow(keras.callbacks.Callback):  # a longer step, on the training thread
        def on_train_batch_begin(self, batch, logs=None):
            time.sleep(args.step_sleep)

    throughput = Throughput(GLOBAL_BATCH_SIZE // groups, SEQUENCE_LENGTH, log_every=2,
                            log_dir=out / f"{args.tag}-run-g{group}", tensorboard=False,
                            progress_bar=False)  # a group's share of each batch
    callbacks = [PrintLoss(), *[Slow()] * bool(args.step_sleep), throughput]
    restored = 0
    if args.ckpt:
        checkpoint = Checkpoint(Path(args.ckpt) / f"group-{group}",
                                save_every_steps=args.save_every, data=data.train)
        restored = checkpoint.restore(model)
        if job:  # a group rejoining a job that went on: from the job's step
            restored = kdist.groups.skip_to_job(checkpoint, model, args.steps)
        callbacks.append(checkpoint)
    def validate():
        return model.evaluate(data.validation, steps=VALIDATION_BATCHES, verbose=0,
                              return_dict=True)["loss"]

    before = validate()
    history = model.fit(data.train, epochs=args.steps, steps_per_epoch=1, shuffle=False,
                        verbose=0, callbacks=callbacks, initial_epoch=0)
    validation = validate()
    print(f"validation loss {validation!r}", flush=True)
    if info.process_count == 1:  # each weight whole in this process
        np.savez(out / f"{args.tag}-g{group}.npz",
                 **{v.path: np.asarray(v.value) for v in model.trainable_variables})
    outer = model.optimizer.groups.outer
    return dict(losses={str(e + 1): float(v) for e, v in
                        zip(history.epoch, history.history["loss"])},
                validation=float(validation), validation_before=float(before),
                restored_step=restored,
                rounds=[] if outer is None else outer.rounds)


COMMANDS = {"train": train, "hf": hf, "hang": hang, "ckpt": ckpt, "wordpiece": wordpiece,
            "devices": devices, "stragglers": stragglers, "groups": groups}

# The cases the multi-process tests read, all run by one launch (``batch``): 2 processes pay
# their imports and the cluster's start-up once for all of them (tests/conftest.py's
# ``multihost_cases``). Each writes to OUT/<slug(name)>/.
CASES = {
    "wordpiece": ["wordpiece"],
    "train fsdp=8": ["train", "--mesh", "fsdp=8"],
    "train data=2,model=4": ["train", "--mesh", "data=2,model=4"],
    "train model=8": ["train", "--mesh", "model=8"],
    "train replica=2,fsdp=4": ["train", "--mesh", "replica=2,fsdp=4", "--sync-every", "2"],
    "devices data=2,model=4": ["devices", "--mesh", "data=2,model=4"],
    "devices data=2,fsdp=2,model=2": ["devices", "--mesh", "data=2,fsdp=2,model=2"],
    "stragglers": ["stragglers", "--mesh", "fsdp=8", "--steps", "12", "--slow-rank", "1",
                   "--slow-seconds", "0.3"],
    # A GPT-2 checkpoint the launcher wrote to ROOT/hf-source (tests/models/hf_fixtures.py).
    "hf fsdp=8": ["hf", "--mesh", "fsdp=8", "--source", "{root}/hf-source"],
    "hf stage=2,fsdp=4": ["hf", "--mesh", "stage=2,fsdp=4", "--scan-layers",
                          "--source", "{root}/hf-source"],
}


def slug(name: str) -> str:
    return name.replace(" ", "_")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=sorted(COMMANDS))
    p.add_argument("--mesh", default="fsdp=8")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", help="checkpoint directory (ckpt)")
    p.add_argument("--save-every", type=int, default=2, help="steps between saves (ckpt)")
    p.add_argument("--hang-at", type=int, default=None, help="stall in this step's commit")
    p.add_argument("--tag", default="run", help="name of the state files written (ckpt)")
    p.add_argument("--sync-every", type=int, default=None, help="DiLoCo's H (train)")
    p.add_argument("--slow-rank", type=int, default=1, help="the slow process (stragglers)")
    p.add_argument("--slow-seconds", type=float, default=0.3, help="its extra seconds per batch")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per batch (groups)")
    p.add_argument("--late-group", type=int, default=None, help="this group starts late")
    p.add_argument("--late-seconds", type=float, default=0.0, help="by this many seconds")
    p.add_argument("--learning-rate", type=float, default=1e-2, help="AdamW's peak (groups)")
    p.add_argument("--source", help="a Hugging Face checkpoint directory (hf)")
    p.add_argument("--scan-layers", action="store_true", help="load it stacked (hf)")
    return p


def run(argv: list[str]) -> None:
    """One command: its result to OUT/<command>-rank<process index>.json."""
    args = parser().parse_args(argv)
    keras.utils.clear_session()  # each command builds from a fresh Keras state
    result = COMMANDS[args.command](args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    group = os.environ.get("KDIST_REPLICA_GROUP")  # one of separate replica group jobs
    name = args.command if group is None else f"{args.command}-g{group}"
    out = Path(args.out) / f"{name}-rank{jax.process_index()}.json"
    out.write_text(json.dumps(result))
    print(f"wrote {out}", flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["batch"]:  # batch --out ROOT: every case of CASES, in order
        root = parser().parse_args(["train", *argv[1:]]).out
        for name, case in CASES.items():
            print(f"case {name}", flush=True)
            case = [a.format(root=root) for a in case]
            run([*case, "--out", str(Path(root) / slug(name))])
        return 0
    run(argv)
    return 0


if __name__ == "__main__":
    # keras-hub imports TensorFlow as it is imported (keras_hub/src/utils/tensor_utils.py),
    # yet its tokenizers run in Python unless traced in a tf.function, and nothing else here
    # uses TensorFlow. So these processes start as on a machine without it (`import
    # tensorflow` fails as if it were not installed): the same tokens and steps, ~3 CPU-s and
    # 4 s less a process (train --mesh data=4: 8.5 -> 5.4 CPU-s, 13 -> 8.5 s, measured).
    sys.modules.setdefault("tensorflow", None)
    sys.exit(main())

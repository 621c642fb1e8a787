"""A training run on token ids, as a machine without TensorFlow runs it: a token store and
numpy ids, a rotary GPT, ``fit`` with kdist's Throughput (TensorBoard on) and Checkpoint, a
``.keras`` round trip. Prints one JSON line: which file tried to import TensorFlow,
keras-hub or TensorBoard (kdist's core: none), what is loaded, the import time, what the
run wrote.

    python tests/token_ids_script.py OUT_DIR [--not-installed]

``--not-installed`` makes those packages fail to import as if they were not installed
(``sys.modules[name] = None``), which is what a core install (``pip install kdist``) is.
Installed, none of them is loaded either: Keras' ``LazyModule`` imported TensorFlow in
``keras.utils.set_random_seed`` and every ``get_config`` until ``import kdist`` made it
ask only once TensorFlow is loaded. ``tests/test_optional.py`` runs this script in
a fresh process; it also runs in a core-only install (it imports only kdist, keras, numpy).
"""

import json
import sys
import time
from pathlib import Path

# Top-level packages kdist's core must not import (tensorflow_text, tensorflow_datasets and
# tensorflow_metadata start with "tensorflow").
OPTIONAL_PREFIXES = ("tensorflow", "keras_hub", "tensorboard")
SEQUENCE, BATCH = 32, 4


NOT_INSTALLED = ("tensorflow", "tensorflow_text", "tensorflow_datasets", "keras_hub",
                 "tensorboard")


class ImportRecorder:
    """A ``sys.meta_path`` finder that records which file imports an optional top-level
    package, and finds nothing itself (the other finders import it, if installed)."""

    def __init__(self):
        self.attempts = []

    def find_spec(self, name, path=None, target=None):
        if "." not in name and name.startswith(OPTIONAL_PREFIXES):
            frame = sys._getframe(1)
            while frame and ("importlib" in frame.f_code.co_filename
                             or frame.f_code.co_filename.startswith("<frozen")):
                frame = frame.f_back
            self.attempts.append([name, frame.f_code.co_filename if frame else "?"])
        return None


def optional_modules_loaded() -> list[str]:
    return sorted({m.split(".")[0] for m in sys.modules
                   if m.startswith(OPTIONAL_PREFIXES) and sys.modules[m] is not None})


class CharacterTokenizer:
    """What ``token_store`` asks of a tokenizer: bytes as ids, 511 as end-of-text."""

    def tokenize(self, texts):
        return [list(text.encode("utf-8")) for text in texts]

    def token_to_id(self, token):
        return 511

    def vocabulary_size(self):
        return 512


def main(out: Path, imports: ImportRecorder) -> dict:
    start = time.perf_counter()
    import kdist

    import_s = time.perf_counter() - start
    after_import = optional_modules_loaded()
    import keras
    import numpy as np

    from kdist.data.lm import LMBatches
    from kdist.data.token_store import token_store

    documents = [f"def f{i}(x):\n    return x * {i}\n" * 20 for i in range(40)]
    tokens = token_store(documents, CharacterTokenizer(), out / "tokens.npy", verbose=False)
    data = LMBatches(tokens, sequence_length=SEQUENCE, global_batch_size=BATCH, seed=0,
                     workers=1)
    keras.utils.set_random_seed(0)
    model = kdist.models.GPTCausalLM.from_preset(
        "gpt-nano", vocabulary_size=512, num_layers=1, position_embedding="rotary")
    model.compile(optimizer=kdist.optim.adamw(1e-3, warmup_steps=1, decay_steps=10))
    throughput = kdist.callbacks.Throughput(BATCH, SEQUENCE, log_dir=out / "log", log_every=2,
                                            progress_bar=False)
    checkpoint = kdist.callbacks.Checkpoint(out / "ckpt", save_every_steps=2, data=data,
                                            verbose=False, handle_signals=False)
    history = model.fit(data, epochs=1, steps_per_epoch=4, verbose=0,
                        callbacks=[throughput, checkpoint])
    ids = np.asarray(tokens[: 2 * BATCH * (SEQUENCE + 1)], "int32").reshape(-1, SEQUENCE + 1)
    numpy_log = kdist.callbacks.Throughput(BATCH, SEQUENCE, log_dir=out / "numpy-log",
                                           log_every=1, progress_bar=False)
    numpy_history = model.fit(ids[:, :-1], ids[:, 1:], batch_size=BATCH, epochs=1,
                              verbose=0, callbacks=[numpy_log])
    model.save(out / "model.keras")
    again = keras.saving.load_model(out / "model.keras")
    x = ids[:1, :-1]
    same = bool(np.array_equal(keras.ops.convert_to_numpy(model(x)),
                               keras.ops.convert_to_numpy(again(x))))
    return {
        "optional_after_import_kdist": after_import,
        "optional_after_run": optional_modules_loaded(),
        "import_attempts": imports.attempts,
        "import_kdist_s": round(import_s, 2),
        "losses": [float(v) for v in history.history["loss"] + numpy_history.history["loss"]],
        "checkpoint_steps": sorted(int(p.name) for p in (out / "ckpt").iterdir()
                                   if p.name.isdigit()),
        "event_files": sorted(p.relative_to(out).parent.as_posix()
                              for p in out.rglob("events.out.tfevents.*")),
        "keras_round_trip_equal": same,
    }


if __name__ == "__main__":
    if "--not-installed" in sys.argv:
        # What Python does for a package that is not installed: `import` raises
        # ModuleNotFoundError and importlib.util.find_spec returns None (etils asks it).
        sys.modules.update(dict.fromkeys(NOT_INSTALLED))
    recorder = ImportRecorder()
    sys.meta_path.insert(0, recorder)
    print(json.dumps(main(Path(sys.argv[1]), recorder)))

"""TensorFlow's native start-up noise is dropped, anything else on standard error kept."""

import subprocess
import sys

from tests.helpers import child_environment

CODE = """
import pathlib, sys, tempfile
import kdist
assert "tensorflow" not in sys.modules  # import kdist loads no TensorFlow
vocabulary = pathlib.Path(tempfile.mkdtemp()) / "vocabulary.txt"
vocabulary.write_text("[PAD]\\n[UNK]\\n[CLS]\\n[SEP]\\n[MASK]\\na\\n")
kdist.data.load_word_piece(vocabulary)  # keras-hub, imported now, loads TensorFlow
import tensorflow as tf
assert "keras_hub" in sys.modules
tf.config.set_visible_devices([], "GPU")  # the GPU probe ("failed call to cuInit"): done
print("a real message", file=sys.stderr)
with kdist.native_noise_filtered():
    print("inside the filter", file=sys.stderr)
"""


def test_tensorflow_loaded_by_kdist_prints_nothing_but_real_messages():
    """Six lines ("oneDNN custom operations", "Could not find cuda drivers", "failed call
    to cuInit: ... ERROR", absl's banner) came before anything a user did: kdist imports
    keras-hub (and with it TensorFlow) inside the filter, and lets TensorFlow probe there."""
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                          env=child_environment(), timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["a real message", "inside the filter"], done.stderr

"""TensorFlow's native start-up noise is dropped, anything else on standard error kept."""

import subprocess
import sys

from tests.helpers import child_environment

CODE = """
import sys
import kdist
import tensorflow as tf
tf.config.set_visible_devices([], "GPU")  # the GPU probe: "failed call to cuInit" on a CPU
kdist.data.byte_pair_tokenizer  # (a keras-hub tokenizer starts TensorFlow's runtime)
print("a real message", file=sys.stderr)
with kdist.native_noise_filtered():
    print("inside the filter", file=sys.stderr)
"""


def test_import_kdist_and_tensorflow_print_nothing_but_real_messages():
    """Six lines ("oneDNN custom operations", "Could not find cuda drivers", "failed call
    to cuInit: ... ERROR", absl's banner) came before anything a user did."""
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                          env=child_environment(), timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["a real message", "inside the filter"], done.stderr

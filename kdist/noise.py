"""Native start-up noise: the lines TensorFlow's and absl's C++ code write to the process's
standard error when TensorFlow loads (kdist's text pipeline and TFDS use keras-hub and TFDS,
which import it) or probes for a GPU — on a CPU machine, six lines ending in "failed call
to cuInit: ... ERROR" that report nothing wrong.

``TF_CPP_MIN_LOG_LEVEL`` no longer silences them (TensorFlow 2.21 logs them through absl
before its log level is read), so :func:`native_noise_filtered` captures file descriptor 2
around such a call and writes back every line except those known ones (the patterns below;
anything else, a real error included, is kept). ``KDIST_NATIVE_LOGS=1`` keeps them all.

``import kdist`` loads no TensorFlow. kdist imports keras-hub, TFDS and TensorFlow when
first used (:func:`kdist._optional.optional_import`), inside the filter and followed there
by :func:`probe_tensorflow_devices` (TensorFlow's GPU platform probe, which prints "failed
call to cuInit" once, whenever it first runs), so later TensorFlow use starts quietly too.

Example:
    >>> with native_noise_filtered():
    ...     probe_tensorflow_devices()
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

# Exactly the lines seen on a CPU machine (TensorFlow 2.21, jax 0.10): the absl banner, the
# oneDNN note, "no CUDA drivers", "failed call to cuInit", and the CUDA plugin's
# registrations and instruction-set notes where they appear.
NOISE = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to "
    r"STDERR$"
    r"|[IWE]\d{4} [\d:.]+ +\d+ (port|cudart_stub|cuda_platform|cuda_executor|cuda_dnn|"
    r"cuda_blas|cuda_fft|cpu_feature_guard|computation_placer)\.cc:\d+\] ")


@contextlib.contextmanager
def native_noise_filtered():
    """Runs the block with standard error (the file descriptor, so C++ writes too) captured,
    then writes back every captured line that is not known start-up noise (:data:`NOISE`).

    Python's own ``sys.stderr`` writes in the block are kept and written back in order.
    Where standard error is not a file descriptor (a test capturing ``sys.stderr``), or with
    ``KDIST_NATIVE_LOGS=1``, the block runs as it is.
    """
    try:
        sys.stderr.flush()
        target = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        target = None
    if target != 2 or os.environ.get("KDIST_NATIVE_LOGS"):
        yield
        return
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode("utf-8", errors="replace")
            kept = [line for line in text.splitlines(keepends=True) if not NOISE.match(line)]
            if kept:
                os.write(2, "".join(kept).encode("utf-8"))


def probe_tensorflow_devices() -> None:
    """Lets TensorFlow, if it is loaded, probe for GPUs now (it does so once per process,
    and on a CPU machine logs "failed call to cuInit"); changes no TensorFlow setting,
    allocates nothing (``tf.config.list_physical_devices``) and never imports TensorFlow."""
    tf = sys.modules.get("tensorflow")
    if tf is not None and hasattr(tf, "config"):
        tf.config.list_physical_devices("GPU")

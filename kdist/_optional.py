"""Optional dependencies: packages only some features need, imported when first used.

Training (models, distribution, optimizer, checkpoints, throughput, token stores and numpy
ids) needs none of them, so ``import kdist`` loads neither TensorFlow nor keras-hub. The
text pipeline (keras-hub's tokenizers, generation's samplers) and TensorFlow Datasets
import them through :func:`optional_import` at the point of use: a missing package is an
``ImportError`` naming the ``pip install 'kdist[EXTRA]'`` that brings it
(:data:`OPTIONAL`; the extras are pyproject.toml's). keras-hub and TFDS load TensorFlow,
which writes native start-up noise, so the import runs inside
:func:`kdist.noise.native_noise_filtered`, and TensorFlow's GPU probe with it.

Example:
    >>> optional_import("tokenizers", "Training a tokenizer").__name__
    'tokenizers'
    >>> import sys; sys.modules["keras_hub"] = None  # as if it were not installed
    >>> optional_import("keras_hub", "A tokenizer")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ImportError: A tokenizer needs the 'keras-hub' package, ... pip install 'kdist[text]' ...
    >>> del sys.modules["keras_hub"]
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from kdist.noise import native_noise_filtered, probe_tensorflow_devices

# module -> (the package pip installs it from, the kdist extra that requires that package).
# TensorFlow itself comes with keras-hub (through tensorflow-text, on Linux and macOS).
OPTIONAL = {
    "keras_hub": ("keras-hub", "text"),
    "tokenizers": ("tokenizers", "text"),
    "tensorflow_datasets": ("tensorflow-datasets", "tfds"),
    "tensorflow": ("tensorflow", "tfds"),
}


def optional_import(module: str, purpose: str) -> ModuleType:
    """``module`` (a key of :data:`OPTIONAL`), imported now if it was not yet.

    ``purpose`` starts the error message: what the caller was doing ("Training a WordPiece
    vocabulary"). A module that cannot be imported (not installed, or blocked by
    ``sys.modules[module] = None``) raises ``ImportError`` naming the package, the extra to
    install and the import's own error.

    Example:
        >>> optional_import("tensorflow_datasets", "Reading TFDS").__name__  # doctest: +SKIP
        'tensorflow_datasets'
    """
    if module not in OPTIONAL:
        raise ValueError(f"{module!r} is not one of kdist's optional dependencies "
                         f"{sorted(OPTIONAL)}; add it to kdist._optional.OPTIONAL with the "
                         f"extra that installs it.")
    loaded = sys.modules.get(module)
    if loaded is not None:
        return loaded
    package, extra = OPTIONAL[module]
    try:
        with native_noise_filtered():  # TensorFlow's banner lines, if this loads it
            loaded = importlib.import_module(module)
            probe_tensorflow_devices()  # its "failed call to cuInit" line, filtered here
    except ImportError as error:
        raise ImportError(
            f"{purpose} needs the '{package}' package, which could not be imported "
            f"({type(error).__name__}: {error}). It is not part of kdist's core install "
            f"(training on token ids needs neither it nor TensorFlow). Install the "
            f"'{extra}' extra: pip install 'kdist[{extra}]' (from a checkout: "
            f"pip install -e '.[{extra}]')."
        ) from error
    return loaded

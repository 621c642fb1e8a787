"""A local Hugging Face model directory: its ``config.json`` and safetensors weights.

:class:`HFCheckpoint` reads the config and every weight file's *header* (names, shapes,
dtypes) when it opens — no tensor data — so a directory is checked whole before anything
is read. Tensors are then read one box at a time (:meth:`HFCheckpoint.read`): safetensors
memory-maps the file and copies out only the requested slice; the file is mapped for one
tensor at a time and unmapped after it, so the pages of tensors already placed do not stay
resident (with one mapping held open for the whole load, every page read stays in the
process's RSS until the end: measured in ``benchmarks/hf_loading.py``).

Weights are ``model.safetensors``, or the shards listed by ``model.safetensors.index.json``
(``weight_map``: tensor name -> file), as ``transformers``' ``save_pretrained`` writes them.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_OTHER_FORMATS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5",
                  "flax_model.msgpack", "model.ckpt.index")

# safetensors dtype names -> numpy (bfloat16 through ml_dtypes, which JAX installs)
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
           "BOOL": "bool"}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype name (``"BF16"`` -> ``ml_dtypes.bfloat16``)."""
    import ml_dtypes  # noqa: F401 (registers bfloat16 with numpy)

    if name not in _DTYPES:
        raise ValueError(f"Unsupported safetensors dtype {name!r}; kdist reads "
                         f"{sorted(_DTYPES)}.")
    return np.dtype(_DTYPES[name])


def _safetensors():
    try:
        import safetensors
    except ImportError:  # a run-time dependency; say how to get it
        raise ImportError("Reading Hugging Face checkpoints needs the 'safetensors' package: "
                          "pip install safetensors (kdist declares it as a dependency).") from None
    return safetensors


class HFCheckpoint:
    """A Hugging Face model directory, opened for reading.

    Attributes:
        directory: the directory.
        config: ``config.json`` as a dict.
        tensors: ``{name: (file, shape, safetensors dtype)}`` of every stored tensor.

    Example:
        >>> ckpt = HFCheckpoint("path/to/gpt2")                   # doctest: +SKIP
        >>> ckpt.config["model_type"], ckpt.shape("wte.weight")   # doctest: +SKIP
        ('gpt2', (50257, 768))
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory).expanduser()
        if not self.directory.is_dir():
            raise ValueError(f"{self.directory} is not a directory. Pass a local Hugging Face "
                             f"model directory (config.json and model.safetensors), e.g. "
                             f"one written by save_pretrained or downloaded with "
                             f"`huggingface-cli download gpt2 --local-dir DIR`.")
        self.config = read_config(self.directory)
        self.tensors = self._headers()

    def _weight_files(self) -> list[str]:
        index = self.directory / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index} is not a safetensors index (a JSON object with a "
                                 f"'weight_map' of tensor name -> file): {e}") from None
            self._index_map = dict(weight_map)
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.directory / f).is_file()]
            if missing:
                raise ValueError(f"{index} lists weight files that are not in "
                                 f"{self.directory}: {missing[:5]}. Download every shard "
                                 f"(or remove the index to use model.safetensors alone).")
            return files
        self._index_map = None
        if (self.directory / WEIGHTS).is_file():
            return [WEIGHTS]
        others = [name for name in _OTHER_FORMATS if (self.directory / name).exists()]
        hint = (f" It holds {others}: kdist reads only safetensors; convert with transformers "
                f"(`AutoModel.from_pretrained(DIR).save_pretrained(OUT)` writes safetensors) "
                f"or download the repository's model.safetensors." if others else "")
        raise ValueError(f"{self.directory} has no {WEIGHTS} and no {INDEX}.{hint}")

    def _headers(self) -> dict[str, tuple[str, tuple[int, ...], str]]:
        safetensors = _safetensors()
        tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}
        for file in self._weight_files():
            try:
                with safetensors.safe_open(self.directory / file, framework="np") as f:
                    header = {name: (tuple(f.get_slice(name).get_shape()),
                                     f.get_slice(name).get_dtype()) for name in f.keys()}
            except (OSError, safetensors.SafetensorError) as e:
                raise ValueError(f"Cannot read the safetensors header of "
                                 f"{self.directory / file}: {e}. The file is damaged or "
                                 f"incomplete; download it again.") from None
            for name, (shape, dtype) in header.items():
                if name in tensors:
                    raise ValueError(f"Tensor '{name}' is stored twice, in "
                                     f"{tensors[name][0]} and {file}.")
                tensors[name] = (file, shape, dtype)
        if self._index_map is not None:
            wrong = [n for n, f in self._index_map.items() if tensors.get(n, (f,))[0] != f]
            if wrong:
                raise ValueError(f"{self.directory / INDEX} places tensors in files that do "
                                 f"not hold them: {wrong[:5]}. The index and the shards do "
                                 f"not belong together.")
        return tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][1]

    def nbytes(self, name: str) -> int:
        _, shape, dtype = self.tensors[name]
        return int(np.prod(shape, dtype=np.int64)) * numpy_dtype(dtype).itemsize

    @contextlib.contextmanager
    def opened(self, name: str) -> Iterator:
        """A reader ``box -> ndarray`` (a tuple of slices) of tensor ``name`` while the
        context lasts: its file memory-mapped, only the box copied out; unmapped on exit."""
        file = self.tensors[name][0]
        numpy_dtype(self.tensors[name][2])  # bfloat16 registered with numpy before the read
        with _safetensors().safe_open(self.directory / file, framework="np") as f:
            part = f.get_slice(name)
            yield lambda box: np.asarray(part[tuple(box)])


def read_config(directory: str | os.PathLike) -> dict:
    """``config.json`` of a Hugging Face model directory, checked to name a ``model_type``.

    Example:
        >>> read_config("path/to/bert")["model_type"]   # doctest: +SKIP
        'bert'
    """
    path = Path(directory).expanduser() / CONFIG
    if not path.is_file():
        raise ValueError(f"{path.parent} has no {CONFIG}. A Hugging Face model directory holds "
                         f"config.json beside its weights; pass that directory.")
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ValueError(f"{path} names no model_type (e.g. \"gpt2\", \"bert\", \"llama\"); it "
                         f"is not a transformers model config.")
    return config

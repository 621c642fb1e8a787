"""Hugging Face checkpoints in and out: the short names (the code is in :mod:`kdist.models.hf`).

    lm = kdist.hf.from_pretrained("path/to/Llama-3.2-1B")   # task from config.json
    kdist.hf.export(lm, "out/", tokenizer=kdist.hf.load_tokenizer("path/to/Llama-3.2-1B"))
    kdist.hf.export_saved("runs/gpt_pretrain", "out/")       # a kdist run's model.keras

Each class has the same as methods: ``GPTCausalLM.from_pretrained(DIR)``,
``model.save_pretrained(DIR)``.
"""

from __future__ import annotations

import os
from pathlib import Path

from kdist.models import BertClassifier, BertMaskedLM, GPTCausalLM
from kdist.models.hf import (
    MODEL_TYPES,
    HFCheckpoint,
    backbone_config,
    export,
    load_tokenizer,
    read_config,
    save_tokenizer,
)

# The kdist task of each Hugging Face architecture (config.json "architectures").
TASKS = {
    "GPT2LMHeadModel": GPTCausalLM, "GPT2Model": GPTCausalLM,
    "LlamaForCausalLM": GPTCausalLM, "LlamaModel": GPTCausalLM,
    "MixtralForCausalLM": GPTCausalLM, "MixtralModel": GPTCausalLM,
    "Qwen3MoeForCausalLM": GPTCausalLM, "Qwen3MoeModel": GPTCausalLM,
    "BertForMaskedLM": BertMaskedLM, "BertForPreTraining": BertMaskedLM,
    "BertModel": BertMaskedLM, "BertForSequenceClassification": BertClassifier,
}
_DEFAULT_TASK = {"gpt2": GPTCausalLM, "llama": GPTCausalLM, "mixtral": GPTCausalLM,
                 "qwen3_moe": GPTCausalLM, "bert": BertMaskedLM}


def task_for(directory: str | os.PathLike):
    """The kdist task class for a Hugging Face directory's ``config.json``.

    Example:
        >>> task_for("path/to/gpt2").__name__   # doctest: +SKIP
        'GPTCausalLM'
    """
    config = read_config(directory)
    for architecture in config.get("architectures") or []:
        if architecture in TASKS:
            return TASKS[architecture]
    model_type = config["model_type"]
    if model_type not in _DEFAULT_TASK:
        raise ValueError(f"Unknown Hugging Face model_type {model_type!r}: kdist loads "
                         f"{', '.join(MODEL_TYPES)} checkpoints.")
    return _DEFAULT_TASK[model_type]


def from_pretrained(directory: str | os.PathLike, **kwargs):
    """The kdist task of a Hugging Face directory (by its ``architectures``), loaded
    sharded under the active distribution (``Task.from_pretrained``)."""
    return task_for(directory).from_pretrained(directory, **kwargs)


def export_saved(source: str | os.PathLike, directory: str | os.PathLike, **kwargs) -> Path:
    """Exports a saved kdist model — a ``.keras`` file, or a recipe's output directory with
    ``model.keras`` and its tokenizer files — as a Hugging Face directory (with the
    tokenizer when the run saved one).

    Example:
        >>> export_saved("runs/gpt_pretrain", "runs/gpt_pretrain/hf")  # doctest: +SKIP
    """
    import keras

    from kdist.data.tokenizer import load_byte_pair
    from kdist.data.wordpiece import load_word_piece

    source = Path(source).expanduser()
    path = source / "model.keras" if source.is_dir() else source
    if path.suffix != ".keras" or not path.is_file():
        raise ValueError(f"{source} is neither a .keras file nor a directory holding "
                         f"model.keras (what recipes/gpt_pretrain.py and bert_pretrain.py "
                         f"write).")
    model = keras.saving.load_model(path, compile=False)
    tokenizer, run = None, path.parent
    if (run / "vocabulary.json").exists() and (run / "merges.txt").exists():
        tokenizer = load_byte_pair(run)
    elif (run / "vocabulary.txt").exists():
        tokenizer = load_word_piece(run / "vocabulary.txt")
    return export(model, directory, tokenizer=tokenizer, **kwargs)


__all__ = ["HFCheckpoint", "MODEL_TYPES", "TASKS", "backbone_config", "export", "export_saved",
           "from_pretrained", "load_tokenizer", "read_config", "save_tokenizer", "task_for"]

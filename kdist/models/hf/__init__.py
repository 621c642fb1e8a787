"""Hugging Face checkpoints in and out of kdist models: GPT-2, Llama (2, 3, 3.1, 3.2),
Mixtral, Qwen3-MoE, BERT.

* :func:`load_pretrained` (behind ``GPTCausalLM.from_pretrained(DIR)``,
  ``BertMaskedLM.from_pretrained``, ``BertClassifier.from_pretrained`` and the backbones'):
  a local directory's ``config.json`` and safetensors weights, streamed tensor by tensor
  into the model already sharded under the active distribution (:mod:`.loading`).
* :func:`export` (``model.save_pretrained(DIR)``): the same format back, one tensor at a
  time from the sharded model (:mod:`.export`).
* :func:`load_tokenizer` / :func:`save_tokenizer`: the directory's tokenizer as a keras-hub
  tokenizer (:mod:`.tokenizers`).

Each family is one small module of config fields and tensor maps (:mod:`.gpt2`,
:mod:`.llama`, :mod:`.mixtral`, :mod:`.qwen3_moe`, :mod:`.bert`); :mod:`.tensors` is the
exact re-indexing they are written in, :mod:`.checkpoint` the directory reader,
:mod:`.stacked` a stacked weight from its layers' (or experts') tensors,
:mod:`.exported_config` the ``config.json`` an export writes.

Example:
    >>> lm = kdist.models.GPTCausalLM.from_pretrained("path/to/gpt2")  # doctest: +SKIP
    >>> lm.save_pretrained("path/to/out")                                # doctest: +SKIP
"""

from kdist.models.hf.checkpoint import HFCheckpoint, read_config
from kdist.models.hf.export import export
from kdist.models.hf.loading import FAMILIES, backbone_config, load_pretrained
from kdist.models.hf.tokenizers import load_tokenizer, save_tokenizer

MODEL_TYPES = tuple(sorted(FAMILIES))

__all__ = ["HFCheckpoint", "MODEL_TYPES", "backbone_config", "export", "load_pretrained",
           "load_tokenizer", "read_config", "save_tokenizer"]

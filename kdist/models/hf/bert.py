"""BERT (``model_type: "bert"``) <-> kdist's ``BertBackbone``, ``BertMaskedLM``, ``BertClassifier``.

BERT's projections are ``nn.Linear`` ``(out, in)``: transposed to Keras' ``(in, out)``, the
attention ones split into heads — query/key/value ``(D, D)`` -> ``(D, N, H)`` with biases
``(D,)`` -> ``(N, H)``, the attention output ``(D, D)`` -> ``(N, H, D)``. Hugging Face BERT's
``hidden_act: "gelu"`` is the exact (erf) GELU: kdist builds the encoder with
``mlp_activation="gelu_exact"``; the masked-LM head (``cls.predictions``: transform, its
LayerNorm, the output bias; the decoder is tied to the word embeddings) is kdist's
``BertMaskedLM`` head, the sequence classifier (``classifier``) ``BertClassifier``'s.

Keys are read with or without the ``bert.`` prefix; the LayerNorm parameters also under
their TensorFlow-era names ``gamma``/``beta``. The pooler and the task heads may be absent
(``BertForMaskedLM`` saves no pooler): those kdist weights then keep their initialisation,
with a warning. Tensors of heads kdist does not build (next-sentence prediction) and the
tied decoder copies are left unread.

A stacked weight (``scan_layers=True``) maps to every layer's tensor through
:func:`~kdist.models.hf.stacked.stacked_map` and :func:`block_tensor_map`.
"""

from __future__ import annotations

import re

from kdist.models.hf.stacked import StackedMap, stacked_map
from kdist.models.hf.tensors import Split, TensorMap, Transpose

MODEL_TYPE = "bert"
# Fields every bert config.json has (to tell a mislabelled model_type in an error).
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "type_vocab_size")
PREFIX = "bert."
IGNORED = re.compile(r"(bert\.)?embeddings\.position_ids|cls\.predictions\.decoder\.(weight|bias)"
                     r"|cls\.seq_relationship\.(weight|bias)")
# Heads a checkpoint may hold for a task other than the one loaded.
HEADS = re.compile(r"cls\.predictions\..*|classifier\.(weight|bias)|(bert\.)?pooler\..*")
OPTIONAL = ("pooler/", "mlm_transform/", "mlm_norm/", "mlm_output_bias/", "classifier_head/")
ALIASES = ((".LayerNorm.weight", ".LayerNorm.gamma"), (".LayerNorm.bias", ".LayerNorm.beta"))

_ACTIVATIONS = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}
_MLM = "mlm_transform/kernel"


def backbone_config(hf: dict) -> dict:
    """kdist ``BertBackbone`` arguments of a BERT ``config.json``."""
    activation = hf.get("hidden_act", "gelu")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"BERT hidden_act {activation!r} is not supported; kdist computes "
                         f"{sorted(_ACTIVATIONS)}.")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"BERT position_embedding_type {hf['position_embedding_type']!r} is "
                         f"not supported; kdist's BERT has absolute (learned) positions.")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise ValueError("BERT as a decoder (is_decoder / add_cross_attention) is not "
                         "supported; kdist's BERT is a bidirectional encoder.")
    return dict(
        vocabulary_size=hf["vocab_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        hidden_dim=hf["hidden_size"],
        intermediate_dim=hf["intermediate_size"],
        max_sequence_length=hf.get("max_position_embeddings", 512),
        num_segments=hf.get("type_vocab_size", 2),
        dropout=float(hf.get("hidden_dropout_prob", 0.1)),
        layer_norm_epsilon=float(hf.get("layer_norm_eps", 1e-12)),
        initializer_range=float(hf.get("initializer_range", 0.02)),
        mlp_activation=_ACTIVATIONS[activation],
    )


def matches(config: dict) -> list[str]:
    """What keeps a kdist config from being a BERT: nothing (every BertBackbone is one)."""
    return []


def check_model(config: dict, paths: set[str]) -> None:
    """Refuses a masked-LM whose encoder GELU is the tanh form: Hugging Face's MLM head
    applies the encoder's ``hidden_act``, kdist's the exact GELU, so no config matches."""
    if _MLM in paths and config["mlp_activation"] != "gelu_exact":
        raise ValueError(
            f"A BertMaskedLM with mlp_activation={config['mlp_activation']!r} (tanh GELU) has "
            f"no Hugging Face equivalent: HF's masked-LM head uses the encoder's hidden_act, "
            f"kdist's head the exact GELU. Use mlp_activation='gelu_exact' (HF BERT's), or "
            f"export/load the backbone (BertBackbone) or a BertClassifier.")


def task_arguments(hf: dict, stored: dict, arguments: set[str], given: dict) -> dict:
    """``num_classes`` for a ``BertClassifier``: given, else the checkpoint's classifier's."""
    if "num_classes" not in arguments or "num_classes" in given:
        return {}
    shape = next((s for name, (_, s, _) in stored.items() if name == "classifier.weight"), None)
    if shape is None:
        raise ValueError("This checkpoint has no sequence-classification head (classifier."
                         "weight), so num_classes cannot be read from it: pass num_classes=N "
                         "(the new head starts at random).")
    return {"num_classes": int(shape[0])}


def hf_config(config: dict, paths: set[str]) -> dict:
    """The ``config.json`` of a kdist BERT model with weights ``paths``."""
    check_model(config, paths)
    architecture = ("BertForMaskedLM" if _MLM in paths else "BertForSequenceClassification"
                    if "classifier_head/kernel" in paths else "BertModel")
    out = {
        "architectures": [architecture],
        "model_type": MODEL_TYPE,
        "vocab_size": config["vocabulary_size"],
        "hidden_size": config["hidden_dim"],
        "num_hidden_layers": config["num_layers"],
        "num_attention_heads": config["num_heads"],
        "intermediate_size": config["intermediate_dim"],
        "hidden_act": "gelu" if config["mlp_activation"] == "gelu_exact" else "gelu_new",
        "max_position_embeddings": config["max_sequence_length"],
        "type_vocab_size": config["num_segments"],
        "layer_norm_eps": config["layer_norm_epsilon"],
        "hidden_dropout_prob": config["dropout"],
        "attention_probs_dropout_prob": 0.0,  # kdist has no attention-probability dropout
        "initializer_range": config["initializer_range"],
        "position_embedding_type": "absolute",
        "pad_token_id": 0,
    }
    return out


def tensor_map(path: str, config: dict) -> TensorMap | StackedMap | None:
    """The HF tensor (and steps) a kdist BERT weight path comes from; None if none."""
    stacked = stacked_map(path, config, tensor_map)  # blocks/...: every layer's tensors
    if stacked is not None:
        return stacked
    d, v = config["hidden_dim"], config["vocabulary_size"]
    linear = (Transpose((1, 0)),)
    layer_path, _, param = path.rpartition("/")
    norms = {"embeddings_norm": PREFIX + "embeddings.LayerNorm",
             "mlm_norm": "cls.predictions.transform.LayerNorm"}
    if layer_path in norms:
        return TensorMap(f"{norms[layer_path]}.{_PARAM[param]}", (d,))
    tables = {"token_embedding": ("word_embeddings", v),
              "position_embedding": ("position_embeddings", config["max_sequence_length"]),
              "segment_embedding": ("token_type_embeddings", config["num_segments"])}
    if layer_path in tables and param == "embeddings":
        name, rows = tables[layer_path]
        return TensorMap(f"{PREFIX}embeddings.{name}.weight", (rows, d))
    dense = {"pooler": PREFIX + "pooler.dense", "mlm_transform": "cls.predictions.transform.dense"}
    if layer_path in dense:
        if param == "kernel":
            return TensorMap(f"{dense[layer_path]}.weight", (d, d), steps=linear)
        return TensorMap(f"{dense[layer_path]}.bias", (d,))
    if path == "mlm_output_bias/bias":
        return TensorMap("cls.predictions.bias", (v,))
    if layer_path == "classifier_head":
        classes = config["num_classes"]
        if param == "kernel":
            return TensorMap("classifier.weight", (classes, d), steps=linear)
        return TensorMap("classifier.bias", (classes,))
    found = re.fullmatch(r"encoder_block_(\d+)/(.+)", path)
    return block_tensor_map(int(found[1]), found[2], config) if found else None


_PARAM = {"gamma": "weight", "beta": "bias", "kernel": "weight", "bias": "bias"}


def block_tensor_map(layer: int, name: str, config: dict) -> TensorMap | None:
    """Encoder block ``layer``'s weight ``name`` (e.g. ``attention/query/bias``)."""
    d, f, n = config["hidden_dim"], config["intermediate_dim"], config["num_heads"]
    h = d // n
    at = f"{PREFIX}encoder.layer.{layer}."
    linear = (Transpose((1, 0)),)
    layer_path, _, param = name.rpartition("/")
    qkv = {"attention/query": "query", "attention/key": "key", "attention/value": "value"}
    if layer_path in qkv:
        key = f"{at}attention.self.{qkv[layer_path]}.{param.replace('kernel', 'weight')}"
        if param == "kernel":  # (D_out, D_in) -> (D_in, N, H)
            return TensorMap(key, (d, d), steps=linear + (Split(1, (n, h)),))
        return TensorMap(key, (d,), steps=(Split(0, (n, h)),))
    if layer_path == "attention/attention_output":
        if param == "kernel":  # (D_out, N*H) -> (N, H, D_out)
            return TensorMap(f"{at}attention.output.dense.weight", (d, d),
                             steps=linear + (Split(0, (n, h)),))
        return TensorMap(f"{at}attention.output.dense.bias", (d,))
    norms = {"attention_norm": "attention.output.LayerNorm", "mlp_norm": "output.LayerNorm"}
    if layer_path in norms:
        return TensorMap(f"{at}{norms[layer_path]}.{_PARAM[param]}", (d,))
    if layer_path == "mlp/up":
        if param == "kernel":
            return TensorMap(f"{at}intermediate.dense.weight", (f, d), steps=linear)
        return TensorMap(f"{at}intermediate.dense.bias", (f,))
    if layer_path == "mlp/down":
        if param == "kernel":
            return TensorMap(f"{at}output.dense.weight", (d, f), steps=linear)
        return TensorMap(f"{at}output.dense.bias", (d,))
    return None

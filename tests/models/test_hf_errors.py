"""Bad Hugging Face checkpoints and arguments: each a clear error from from_pretrained,
before any tensor is read or any step compiled, naming what is wrong and the fix."""

import json

import keras
import numpy as np
import pytest

import kdist
from kdist import _keras_compat
from kdist.models import BertBackbone, BertClassifier, BertMaskedLM, GPTBackbone, GPTCausalLM
from tests.models.hf_fixtures import write_checkpoint


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt2")
    return directory, write_checkpoint(directory, "gpt2")


def edited(tmp_path, tensors, family="gpt2", **config):
    write_checkpoint(tmp_path, family, tensors=tensors, **config)
    return tmp_path


def test_missing_unexpected_and_misshapen_tensors_are_named(gpt2, tmp_path):
    directory, tensors = gpt2
    bad = dict(tensors)
    del bad["transformer.h.1.mlp.c_fc.bias"]
    bad["transformer.h.0.attn.c_proj.weight"] = np.zeros((64, 32), "float32")
    bad["transformer.h.0.adapter.weight"] = np.zeros((4,), "float32")
    with pytest.raises(ValueError) as error:
        GPTCausalLM.from_pretrained(edited(tmp_path, bad))
    message = str(error.value)
    assert "tensor 'transformer.h.1.mlp.c_fc.bias' (256,) (for 'block_1/mlp/up/bias') is " \
           "missing" in message
    assert "tensor 'transformer.h.0.attn.c_proj.weight' has shape (64, 32) in the checkpoint " \
           "but this model needs (64, 64)" in message
    assert "tensor 'transformer.h.0.adapter.weight' (4,) is unexpected" in message
    assert _keras_compat.initialize_pending_variables() == 0  # nothing left half-built
    GPTCausalLM.from_pretrained(directory)  # and the next load is unaffected


def test_an_override_that_changes_a_shape_names_both_shapes(gpt2):
    with pytest.raises(ValueError, match=r"'transformer.wpe.weight' has shape \(32, 64\) in the "
                                         r"checkpoint but this model needs \(16, 64\)"):
        GPTCausalLM.from_pretrained(gpt2[0], max_sequence_length=16)
    with pytest.raises(TypeError, match=r"unknown arguments \['hidden_size'\]"):
        GPTCausalLM.from_pretrained(gpt2[0], hidden_size=32)
    with pytest.raises(ValueError, match="has no gpt2 tensor .* fused_qkv=True"):
        GPTCausalLM.from_pretrained(gpt2[0], fused_qkv=True)


def test_unknown_model_types_and_the_wrong_class_are_refused(gpt2, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    (tmp_path / "model.safetensors").write_bytes((gpt2[0] / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="Unknown Hugging Face model_type 't5': kdist loads "
                                         "bert, gpt2, llama, mixtral, qwen3_moe "
                                         "checkpoints"):
        GPTCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Unknown Hugging Face model_type 't5'"):
        kdist.hf.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="BertMaskedLM cannot load a 'gpt2' checkpoint .* use "
                                         "GPTCausalLM"):
        BertMaskedLM.from_pretrained(gpt2[0])


def test_gpt_vocabularies_are_padded_for_the_model_axis_or_refused_with_the_fix(gpt2, tmp_path):
    tensors = dict(gpt2[1])
    tensors["transformer.wte.weight"] = np.ones((301, 64), "float32")  # odd: no model=2 split
    directory = edited(tmp_path, tensors, vocab_size=301)
    keras.distribution.set_distribution(kdist.distribution("fsdp=4,model=2"))
    lm = GPTCausalLM.from_pretrained(directory)  # padded to 384 rows by default
    assert lm.backbone.token_embedding.embeddings.shape == (384, 64)
    assert lm.predict_on_batch(np.zeros((4, 8), "int32")).shape == (4, 8, 301)
    with pytest.raises(ValueError, match="vocabulary_size=301 is not divisible by the 'model' "
                                         "mesh axis of size 2.*vocabulary_divisible_by=128"):
        GPTCausalLM.from_pretrained(directory, vocabulary_divisible_by=1)


def test_bert_vocabularies_the_model_axis_does_not_divide_are_refused(tmp_path):
    write_checkpoint(tmp_path, "bert", vocab_size=301)
    keras.distribution.set_distribution(kdist.distribution("fsdp=4,model=2"))
    with pytest.raises(ValueError, match=r"vocabulary of 301 tokens does not divide by the "
                                         r"'model' mesh axis of size 2.*among \[1, 7, 43\]"):
        BertMaskedLM.from_pretrained(tmp_path)


def test_directory_problems(gpt2, tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        GPTCausalLM.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="has no config.json"):
        GPTCausalLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    with pytest.raises(ValueError, match="names no model_type"):
        GPTCausalLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((gpt2[0] / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="has no model.safetensors .* kdist reads only "
                                         "safetensors"):
        GPTCausalLM.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match="lists weight files that are not in"):
        GPTCausalLM.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    data = (gpt2[0] / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:100])  # a truncated download
    with pytest.raises(ValueError, match="Cannot read the safetensors header .* download it "
                                         "again"):
        GPTCausalLM.from_pretrained(tmp_path)


def test_config_variants_kdist_does_not_compute_are_refused(gpt2, tmp_path):
    cases = [
        ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
        ("gpt2", dict(activation_function="relu"), "activation_function 'relu'"),
        ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
         "rope_scaling of type 'yarn' is not supported"),
        ("llama", dict(attention_bias=True), "attention_bias"),
        ("llama", dict(head_dim=32), "head_dim=32"),
        ("bert", dict(position_embedding_type="relative_key"), "relative_key"),
        ("bert", dict(hidden_act="relu"), "hidden_act 'relu'"),
    ]
    for family, config, message in cases:
        write_checkpoint(tmp_path / family, family, tensors={"x": np.zeros(1, "float32")},
                         **config)
        cls = BertBackbone if family == "bert" else GPTBackbone
        with pytest.raises(ValueError, match=message):
            cls.from_pretrained(tmp_path / family)


def test_a_classifier_needs_num_classes_without_a_head(tmp_path):
    write_checkpoint(tmp_path, "bert")
    with pytest.raises(ValueError, match="no sequence-classification head .* pass "
                                         "num_classes=N"):
        BertClassifier.from_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="classifier_head/kernel"):
        clf = BertClassifier.from_pretrained(tmp_path, num_classes=3)  # a new head
    assert clf.num_classes == 3
    # A masked LM whose encoder GELU is not HF's exact one cannot match HF's head.
    with pytest.raises(ValueError, match="has no Hugging Face equivalent"):
        BertMaskedLM.from_pretrained(tmp_path, mlp_activation="gelu")


def test_a_config_whose_model_type_does_not_match_its_fields_says_so(gpt2, tmp_path):
    config = json.loads((gpt2[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    (tmp_path / "model.safetensors").write_bytes((gpt2[0] / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"says model_type 'bert' but has no "
                                         r"'num_hidden_layers' field.*look like a 'gpt2' "
                                         r"config: is model_type wrong\?"):
        BertMaskedLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="says model_type 'bert' but has no"):
        kdist.hf.backbone_config(tmp_path)


def test_integer_weights_are_refused_not_cast(gpt2, tmp_path):
    tensors = dict(gpt2[1])
    tensors["transformer.h.0.mlp.c_fc.weight"] = np.ones((64, 256), "int32")
    with pytest.raises(ValueError, match=r"tensor 'transformer.h.0.mlp.c_fc.weight' is stored "
                                         r"as I32, not a floating-point type"):
        GPTCausalLM.from_pretrained(edited(tmp_path, tensors))

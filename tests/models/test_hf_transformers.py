"""kdist against Hugging Face ``transformers`` itself (the optional ``hf-test`` extra: torch
2.13 CPU + transformers): tiny random models it creates and saves load into sharded kdist
models with the same logits (<= 1e-4 in float32), and what kdist exports loads back into
``transformers`` with no missing or unexpected weight and the same logits."""

import keras
import numpy as np
import pytest

import kdist
from kdist.models import BertClassifier, BertMaskedLM, GPTCausalLM

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MESH = "data=2,fsdp=2,model=2"
IDS = np.random.default_rng(0).integers(0, 304, (2, 24))
MASK = np.ones_like(IDS)
MASK[1, 17:] = 0
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
SMALL = dict(vocab_size=304, initializer_range=0.2)  # far from uniform attention


def hf_models():
    t = transformers
    return {
        "gpt2": (t.GPT2LMHeadModel, t.GPT2Config(**SMALL, n_positions=32, n_embd=64, n_layer=2,
                                                  n_head=4), GPTCausalLM),
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(
            **SMALL, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=LLAMA3), GPTCausalLM),
        "bert-mlm": (t.BertForMaskedLM, t.BertConfig(
            **SMALL, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, max_position_embeddings=32), BertMaskedLM),
        "bert-classifier": (t.BertForSequenceClassification, t.BertConfig(
            **SMALL, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, max_position_embeddings=32, num_labels=3), BertClassifier),
    }


def hf_logits(model):
    kwargs = {"attention_mask": torch.tensor(MASK)} if "bert" in type(model).__name__.lower() \
        else {}
    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS), **kwargs).logits.numpy()


def kdist_logits(model, name):
    if not name.startswith("bert"):
        return np.asarray(model.predict_on_batch(IDS.astype("int32")))
    x = {"token_ids": IDS.astype("int32"), "segment_ids": np.zeros_like(IDS, "int32"),
         "padding_mask": MASK.astype("int32")}
    if name == "bert-mlm":
        x["mask_positions"] = np.tile(np.arange(24, dtype="int32"), (2, 1))
    return np.asarray(model.predict_on_batch(x))


def compare(got, want, name):
    if name == "bert-mlm":  # real positions only: padded ones are not defined the same way
        got, want = [np.concatenate([a[0], a[1, :17]]) for a in (got, want)]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    assert np.abs(want).max() > 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert-mlm", "bert-classifier"])
def test_logits_match_transformers_both_ways(name, tmp_path):
    hf_class, config, kdist_class = hf_models()[name]
    torch.manual_seed(0)
    reference = hf_class(config).eval()
    reference.save_pretrained(tmp_path / "hf")
    want = hf_logits(reference)

    keras.distribution.set_distribution(kdist.distribution(MESH))
    no_dropout = {"classifier_dropout": 0.0} if name == "bert-classifier" else {}
    model = kdist_class.from_pretrained(tmp_path / "hf", dropout=0.0, **no_dropout)
    got = kdist_logits(model, name)
    compare(got, want, name)

    model.save_pretrained(tmp_path / "kdist")
    back, info = hf_class.from_pretrained(tmp_path / "kdist", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    unexpected = [k for k in info["unexpected_keys"] if "pooler" not in k]  # MLM has none
    assert not unexpected, info
    compare(got, hf_logits(back.eval()), name)

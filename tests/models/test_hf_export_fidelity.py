"""What kdist exports is what it trained, read by ``transformers`` itself (the ``hf-test``
extra): for each family, the exported tokenizer gives kdist's ids on real text (a standard
library module), the exported model kdist's logits on them; the config keeps every field
kdist read from a source checkpoint (and those it does not read), names the tokenizer's
special tokens, and a classifier keeps its label names."""

import inspect
import json
import os

import keras
import numpy as np
import pytest

import kdist
from kdist.models import BertBackbone, BertClassifier, GPTBackbone, GPTCausalLM
from tests.helpers import TINY_GPT, TINY_LLAMA
from tests.models.test_hf_transformers import hf_models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXT = inspect.getsource(os)  # real text: the os module's source
VOCABULARY = 1024  # the size other tests train too (one cached tokenizer)


@pytest.fixture(scope="module")
def byte_pair():
    return kdist.data.byte_pair_tokenizer(kdist.data.load_corpus(), VOCABULARY)


@pytest.fixture(scope="module")
def word_piece():
    return kdist.data.word_piece_tokenizer(kdist.data.load_corpus(), VOCABULARY)


def logits_of(hf_model, ids, **kwargs):
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor(ids), **kwargs).logits.numpy()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_causal_lm_exports_its_tokenizer_ids_logits_and_token_ids(family, byte_pair,
                                                                    tmp_path):
    keras.distribution.set_distribution(kdist.distribution("fsdp=4,model=2"))
    keras.utils.set_random_seed(0)
    shape = TINY_GPT if family == "gpt2" else TINY_LLAMA
    lm = GPTCausalLM(GPTBackbone(**{**shape, "vocabulary_size": VOCABULARY,
                                    "max_sequence_length": 64}))
    lm.save_pretrained(tmp_path, tokenizer=byte_pair)

    ids = np.asarray(byte_pair.tokenize(TEXT))
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    hf_ids = hf_tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    first = next((i for i, (a, b) in enumerate(zip(ids, hf_ids)) if a != b), None)
    assert first is None and len(hf_ids) == len(ids), f"ids differ from token {first}"
    assert hf_tokenizer.decode(hf_ids) == TEXT

    config = json.loads((tmp_path / "config.json").read_text())
    end = byte_pair.token_to_id("<|endoftext|>")
    assert config["bos_token_id"] == config["eos_token_id"] == end < VOCABULARY
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {
        "bos_token_id": end, "eos_token_id": end}
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf_model.generation_config.eos_token_id == end
    window = ids[None, :64].astype("int32")
    np.testing.assert_allclose(np.asarray(lm.predict_on_batch(window)),
                               logits_of(hf_model, window), rtol=0, atol=1e-4)


def test_a_bert_classifier_exports_its_tokenizer_and_label_names(word_piece, tmp_path):
    keras.distribution.set_distribution(kdist.distribution("data=2,fsdp=2,model=2"))
    keras.utils.set_random_seed(0)
    names = ["asyncio", "email", "xml"]
    backbone = BertBackbone(vocabulary_size=VOCABULARY, num_layers=2, num_heads=2,
                            hidden_dim=64, intermediate_dim=128, max_sequence_length=64,
                            mlp_activation="gelu_exact")
    model = BertClassifier(backbone, num_classes=3)
    model.save_pretrained(tmp_path, tokenizer=word_piece, label_names=names)

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    cls, sep = (word_piece.token_to_id(t) for t in ("[CLS]", "[SEP]"))
    ids = [cls, *np.asarray(word_piece.tokenize(TEXT)).tolist(), sep]  # as kdist encodes
    hf_ids = hf_tokenizer(TEXT)["input_ids"]
    first = next((i for i, (a, b) in enumerate(zip(ids, hf_ids)) if a != b), None)
    assert first is None and len(hf_ids) == len(ids), f"ids differ from token {first}"

    hf_model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert hf_model.config.id2label == dict(enumerate(names))
    window = np.asarray([ids[:64]], "int32")
    x = {"token_ids": window, "segment_ids": np.zeros_like(window),
         "padding_mask": np.ones_like(window)}
    np.testing.assert_allclose(np.asarray(model.predict_on_batch(x)),
                               logits_of(hf_model, window), rtol=0, atol=1e-4)


class Reads(dict):
    """A config dict that records the fields read from it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert-classifier"])
def test_load_then_export_keeps_every_config_field(name, tmp_path):
    hf_class, config, kdist_class = hf_models()[name]
    fields = dict(bos_token_id=7, eos_token_id=8)  # not transformers' defaults
    if name == "gpt2":
        fields.update(attn_pdrop=0.1, n_inner=None)  # unread by kdist; null = 4 x n_embd
    if name == "bert-classifier":
        fields.update(id2label={0: "neg", 1: "mid", 2: "pos"},
                      label2id={"neg": 0, "mid": 1, "pos": 2})
    for key, value in fields.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    hf_class(config).save_pretrained(tmp_path / "hf")
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    reads = Reads(source)
    kdist.models.hf.loading.FAMILIES[source["model_type"]].backbone_config(reads)

    kdist_class.from_pretrained(tmp_path / "hf").save_pretrained(tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    kept = reads.read | {"bos_token_id", "eos_token_id", "attn_pdrop", "id2label"}
    changed = {k: (source[k], exported.get(k)) for k in sorted(kept & set(source))
               if exported.get(k) != source[k]}
    assert not changed, f"fields changed by load -> export (source, exported): {changed}"

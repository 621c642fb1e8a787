"""Mixtral checkpoints in and out of kdist's MoE GPT (``kdist/models/hf/mixtral.py``), against
``transformers``' own ``MixtralForCausalLM`` (the optional ``hf-test`` extra): a tiny random
Mixtral (2 layers, 4 experts, top-2, GQA) it creates and saves gives the same logits in
kdist (float32, <= 1e-5), on one device and loaded sharded over the ``expert`` axis (each
device reading only its own experts); kdist's export loads back into transformers with no
missing or unexpected weight and the same logits. The config mapping's refusals are
checked on config dicts (no model built)."""

import json
import warnings

import numpy as np
import pytest

import kdist
from kdist.models import GPTCausalLM
from kdist.models.hf import backbone_config, export, mixtral
from tests.models.hf_fixtures import assert_loads_sharded

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Batch 8: the expert and data axes together split it 8 ways.
IDS = np.random.default_rng(0).integers(0, 304, (8, 16))
TINY = dict(vocab_size=304, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-5,
            tie_word_embeddings=False, initializer_range=0.15, output_router_logits=True,
            router_aux_loss_coef=0.02)


def hf_logits(model):
    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS)).logits.numpy()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A random Mixtral saved by transformers (the Hub's per-expert w1/w2/w3 tensors) and
    its logits."""
    directory = tmp_path_factory.mktemp("mixtral") / "hf"
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**TINY)).eval()
    model.save_pretrained(directory)
    return directory, hf_logits(model)


def test_logits_match_transformers_both_ways(reference, tmp_path):
    directory, want = reference
    lm = GPTCausalLM.from_pretrained(directory)
    got = np.asarray(lm.predict_on_batch(IDS.astype("int32")))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert np.abs(want).max() > 1

    export(lm, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["router_aux_loss_coef"] == 0.02 and written["output_router_logits"]
    back, info = transformers.MixtralForCausalLM.from_pretrained(tmp_path,
                                                                 output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    np.testing.assert_allclose(hf_logits(back.eval()), got, rtol=0, atol=1e-5)


def test_loads_into_and_exports_from_a_scanned_stack(reference, tmp_path):
    # The stack's expert weights are (L, E, ...): every layer's every expert's tensor, read
    # into its row and written back per layer and expert (transformers reads the export).
    directory, want = reference
    lm = GPTCausalLM.from_pretrained(directory, scan_layers=True)
    gate = next(w for w in lm.weights if w.path == "blocks/moe/gate")
    assert tuple(gate.shape) == (2, 4, 64, 48)  # (L, E, D, F)
    got = np.asarray(lm.predict_on_batch(IDS.astype("int32")))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    export(lm, tmp_path)
    back, info = transformers.MixtralForCausalLM.from_pretrained(tmp_path,
                                                                 output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    np.testing.assert_allclose(hf_logits(back.eval()), got, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mesh, shard, reads", [("expert=2,data=4", (2, 64, 48), 1),
                                                 ("expert=4,fsdp=2", (1, 32, 48), 2)])
def test_loads_sharded_over_experts(reference, mesh, shard, reads, monkeypatch, tmp_path):
    # Each expert tensor is read once per box that holds it: by the devices of its expert
    # shard (and, under fsdp, once per half of the hidden axis); exported bit-exact.
    assert_loads_sharded(*reference, IDS, mesh, shard,  # gate (4, 64, 48)
                         "layers.0.block_sparse_moe.experts.0.w1.weight", reads, monkeypatch,
                         tmp_path)


def test_config_mapping_and_refusals():
    config = {**TINY, "model_type": "mixtral", "sliding_window": None}
    moe = mixtral.backbone_config(config)["moe"]
    # transformers' balance loss is one over all layers' tokens; kdist's one per layer.
    assert moe == dict(num_experts=4, experts_per_token=2, router="softmax",
                       aux_loss_weight=0.01, z_loss_weight=0.0)
    assert mixtral.backbone_config({**config, "output_router_logits": False}
                                   )["moe"]["aux_loss_weight"] == 0.0
    with pytest.raises(ValueError, match="sliding_window=16 .*full causal"):
        mixtral.backbone_config({**config, "sliding_window": 16})
    assert mixtral.backbone_config({**config, "sliding_window": 4096})  # no window in 64
    with pytest.raises(ValueError, match="Mixtral head_dim=32"):
        mixtral.backbone_config({**config, "head_dim": 32})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mixtral.backbone_config({**config, "router_jitter_noise": 0.01})
    assert "router_jitter_noise=0.01" in str(caught[0].message)

    kdist_config = GPTCausalLM.backbone_class.full_config(
        {**mixtral.backbone_config(config), "fused_qkv": False})
    assert mixtral.matches(kdist_config) == []
    shared = {**kdist_config, "moe": {**kdist_config["moe"], "shared_experts": 1}}
    assert mixtral.matches(shared) == ["moe['shared_experts']=1 (Mixtral: 0)"]
    scaled = {**kdist_config, "moe": {**kdist_config["moe"], "routed_scale": 2.0}}
    assert mixtral.matches(scaled) == ["moe['routed_scale']=2.0 (Mixtral: 1.0)"]
    gelu = {**kdist_config, "moe": {**kdist_config["moe"], "activation": "gelu"}}
    assert mixtral.matches(gelu) == ["moe['activation']='gelu' (Mixtral: 'swiglu')"]
    assert "moe=... (Llama: a dense MLP)" in kdist.models.hf.llama.matches(kdist_config)


def test_backbone_config_of_a_directory(reference):
    directory, _ = reference
    assert backbone_config(directory)["moe"]["num_experts"] == 4
    assert kdist.hf.task_for(directory) is GPTCausalLM


def test_a_kdist_built_moe_model_exports_as_mixtral(tmp_path):
    """No source config.json to merge: every field comes from kdist's config (expert width
    other than intermediate_dim, kdist's default loss weights)."""
    backbone = kdist.models.GPTBackbone(
        vocabulary_size=128, num_layers=2, num_heads=4, num_key_value_heads=2, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=32, position_embedding="rotary",
        norm="rms_norm", mlp_activation="swiglu", use_bias=False, initializer_range=0.2,
        moe={"num_experts": 4, "experts_per_token": 2, "expert_dim": 24})
    lm = GPTCausalLM(backbone)
    ids = IDS[:2, :12] % 128
    got = np.asarray(lm.predict_on_batch(ids.astype("int32")))
    lm.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["intermediate_size"], written["router_aux_loss_coef"]) == (24, 0.02)
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        want = back(input_ids=torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)

    gpt2_style = kdist.models.GPTBackbone(
        vocabulary_size=128, num_layers=1, num_heads=2, hidden_dim=32, intermediate_dim=64,
        max_sequence_length=32, moe={"num_experts": 2})
    with pytest.raises(ValueError, match=r"as mixtral: position_embedding='learned'"):
        export(gpt2_style, tmp_path / "refused")

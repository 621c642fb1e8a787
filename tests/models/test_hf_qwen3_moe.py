"""Qwen3-MoE checkpoints in and out of kdist's MoE GPT (``kdist/models/hf/qwen3_moe.py``),
against ``transformers``' own ``Qwen3MoeForCausalLM`` (the optional ``hf-test`` extra):
tiny random Qwen3-MoEs (head_dim 24 at width 64 with 4 heads, per-head q/k norms, GQA,
4 experts top-2; renormalised top-k with experts in every block, and un-renormalised with
every second block dense and tied embeddings) it creates and saves give the same logits in
kdist (float32, <= 1e-5), on one device and loaded sharded (over ``expert`` and ``fsdp``;
over ``model``, which splits the 24-wide heads and the experts' width); kdist's export
loads back into transformers with no missing or unexpected weight and the same logits.
The config mapping's refusals are checked on config dicts."""

import json

import numpy as np
import pytest

import kdist
from kdist.models import GPTBackbone, GPTCausalLM
from kdist.models.hf import backbone_config, export, mixtral, qwen3_moe
from tests.models.hf_fixtures import assert_loads_sharded

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IDS = np.random.default_rng(0).integers(0, 304, (8, 16))  # batch 8: split 8 ways at most
TINY = dict(vocab_size=304, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
            num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.15,
            norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.02)
VARIANTS = {"renormalised": {},
            "dense-every-second-tied": dict(norm_topk_prob=False, decoder_sparse_step=2,
                                            tie_word_embeddings=True)}


def hf_logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits.numpy()


@pytest.fixture(scope="module", params=list(VARIANTS))
def reference(request, tmp_path_factory):
    """A random Qwen3-MoE saved by transformers (per-expert gate/up/down_proj tensors),
    its norms' weights moved off 1 so that a norm read wrongly shows, and its logits."""
    directory = tmp_path_factory.mktemp("qwen3_moe") / "hf"
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**{**TINY, **VARIANTS[request.param]})
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.add_(0.3 * torch.randn_like(weight))
    model.save_pretrained(directory)
    return directory, hf_logits(model), request.param


def test_logits_match_transformers_both_ways(reference, tmp_path):
    directory, want, variant = reference
    lm = GPTCausalLM.from_pretrained(directory)
    got = np.asarray(lm.predict_on_batch(IDS.astype("int32")))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert np.abs(want).max() > 1
    config = lm.backbone.get_config()
    assert (config["head_dim"], config["qk_norm"]) == (24, True)
    assert config["moe"]["renormalize"] == (variant == "renormalised")

    export(lm, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "qwen3_moe" and written["head_dim"] == 24
    assert written["norm_topk_prob"] == (variant == "renormalised")
    assert written["router_aux_loss_coef"] == 0.02 and written["output_router_logits"]
    back, info = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path,
                                                                  output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    np.testing.assert_allclose(hf_logits(back.eval()), got, rtol=0, atol=1e-5)


@pytest.mark.parametrize("reference", ["renormalised"], indirect=True)
@pytest.mark.parametrize("mesh, shard, reads", [("expert=4,fsdp=2", (1, 32, 48), 2),
                                                 ("data=4,model=2", (4, 64, 24), 2)])
def test_loads_sharded_over_experts(reference, mesh, shard, reads, monkeypatch, tmp_path):
    # An expert tensor is read once per box that holds it (its expert shard's devices, a
    # half of its hidden or expert width each); exported bit-exact.
    directory, want, _ = reference
    assert_loads_sharded(directory, want, IDS, mesh, shard,  # gate (4, 64, 48)
                         "layers.0.mlp.experts.0.gate_proj.weight", reads, monkeypatch,
                         tmp_path)


def test_config_mapping_and_refusals():
    config = {**TINY, "model_type": "qwen3_moe", "num_hidden_layers": 4,
              "decoder_sparse_step": 2}
    kdist_config = qwen3_moe.backbone_config(config)
    assert (kdist_config["head_dim"], kdist_config["qk_norm"],
            kdist_config["intermediate_dim"]) == (24, True, 96)
    # transformers' balance loss is one over the MoE layers' tokens; kdist's one per layer.
    assert kdist_config["moe"] == dict(
        num_experts=4, experts_per_token=2, expert_dim=48, every=2, router="softmax",
        renormalize=True, aux_loss_weight=0.01, z_loss_weight=0.0)
    # transformers 5 writes the expert count as num_local_experts; the Hub as num_experts.
    local = {k: v for k, v in config.items() if k != "num_experts"}
    assert qwen3_moe.backbone_config({**local, "num_local_experts": 4}) == kdist_config
    assert qwen3_moe.backbone_config({**config, "head_dim": 16})["head_dim"] is None
    assert not qwen3_moe.backbone_config({**config, "norm_topk_prob": False}
                                         )["moe"]["renormalize"]
    # Dense layers decoder_sparse_step leaves dense anyway: the same model.
    assert qwen3_moe.backbone_config({**config, "mlp_only_layers": [0, 2]}) == kdist_config
    refusals = {"mlp_only_layers=\\[1\\]": dict(mlp_only_layers=[1]),
                "sliding_window=16": dict(use_sliding_window=True, sliding_window=16),
                "num_experts=0": dict(num_experts=0),
                "neither num_experts nor num_local_experts": dict(num_experts=None),
                "decoder_sparse_step=5": dict(decoder_sparse_step=5),
                "no head_dim and hidden_size=66": dict(head_dim=None, hidden_size=66)}
    for message, fields in refusals.items():
        with pytest.raises(ValueError, match=message):
            qwen3_moe.backbone_config({**config, **fields})
    assert qwen3_moe.backbone_config({**config, "sliding_window": 16})  # not in use

    full = GPTBackbone.full_config(kdist_config)
    assert qwen3_moe.matches(full) == []
    assert "qk_norm=False (Qwen3-MoE: query/key norms)" in qwen3_moe.matches(
        {**full, "qk_norm": False})
    shared = {**full, "moe": {**full["moe"], "shared_experts": 1}}
    assert qwen3_moe.matches(shared) == ["moe['shared_experts']=1 (Qwen3-MoE: 0)"]
    scaled = {**full, "moe": {**full["moe"], "routed_scale": 2.0}}
    assert qwen3_moe.matches(scaled) == ["moe['routed_scale']=2.0 (Qwen3-MoE: 1.0)"]
    gelu = {**full, "moe": {**full["moe"], "activation": "gelu"}}
    assert qwen3_moe.matches(gelu) == ["moe['activation']='gelu' (Qwen3-MoE: 'swiglu')"]
    not_mixtral = mixtral.matches(full)
    assert {"head_dim=24 (Llama: hidden_dim / num_heads = 16)", "qk_norm=True (Llama: no "
            "query/key norms)", "moe['every']=2 (Mixtral: 1)"} <= set(not_mixtral)
    assert "moe['renormalize']=False (Mixtral: True)" in mixtral.matches(
        {**full, "moe": {**full["moe"], "renormalize": False}})


def test_backbone_config_of_a_directory(reference):
    directory, _, _ = reference
    assert backbone_config(directory)["moe"]["num_experts"] == 4
    assert kdist.hf.task_for(directory) is GPTCausalLM


def test_a_kdist_built_model_exports_as_qwen3_moe(tmp_path):
    """No source config.json: every field comes from kdist's config. A MoE model without
    the query/key norms stays a Mixtral."""
    shape = dict(vocabulary_size=128, num_layers=2, num_heads=4, num_key_value_heads=2,
                 hidden_dim=32, intermediate_dim=64, max_sequence_length=32,
                 position_embedding="rotary", norm="rms_norm", mlp_activation="swiglu",
                 use_bias=False, initializer_range=0.2)
    moe = {"num_experts": 4, "experts_per_token": 2, "expert_dim": 24, "every": 2,
           "renormalize": False}
    lm = GPTCausalLM(GPTBackbone(**shape, head_dim=16, qk_norm=True, moe=moe))
    ids = IDS[:2, :12] % 128
    got = np.asarray(lm.predict_on_batch(ids.astype("int32")))
    lm.save_pretrained(tmp_path / "qwen")
    written = json.loads((tmp_path / "qwen" / "config.json").read_text())
    assert (written["model_type"], written["head_dim"], written["decoder_sparse_step"],
            written["norm_topk_prob"], written["intermediate_size"],
            written["moe_intermediate_size"]) == ("qwen3_moe", 16, 2, False, 64, 24)
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "qwen").eval()
    np.testing.assert_allclose(hf_logits(back, ids), got, rtol=0, atol=1e-5)

    plain = GPTCausalLM(GPTBackbone(**shape, moe={"num_experts": 4}))
    plain.save_pretrained(tmp_path / "mixtral")
    written = json.loads((tmp_path / "mixtral" / "config.json").read_text())
    assert written["model_type"] == "mixtral"

"""Hugging Face checkpoints written with numpy: HF key names, shapes and config fields of
small random GPT-2, Llama-3 and BERT models, so no test needs a download (or torch).

``write_checkpoint(directory, family, shards=N)`` writes ``config.json`` and
``model.safetensors`` (or ``N`` shards and ``model.safetensors.index.json``). Weights are
drawn with a large scale (0.2 where HF initialises with 0.02; norms around 1) so attention
is far from uniform and a wrong head order, transpose or RoPE frequency changes the outputs
visibly. ``assert_loads_sharded`` loads a MoE checkpoint under a mesh and checks its
logits, expert shards, reads and export.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

GPT2 = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=300, n_embd=64,
            n_layer=2, n_head=4, n_inner=None, n_positions=32, activation_function="gelu_new",
            layer_norm_epsilon=1e-5, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
            initializer_range=0.02, tie_word_embeddings=True)
# Llama 3.2 style: GQA (4 query heads per 2 key/value heads), llama3 RoPE scaling over a
# short "original" context so that a 32-token sequence crosses every frequency band.
# rms_norm_eps 1e-6: keras-hub's converter ignores the config's epsilon and uses 1e-6.
LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=300,
             hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
             rope_theta=500000.0, hidden_act="silu", tie_word_embeddings=False,
             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                               high_freq_factor=4.0, original_max_position_embeddings=16))
BERT = dict(model_type="bert", architectures=["BertForPreTraining"], vocab_size=304,
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=32, type_vocab_size=2, hidden_act="gelu",
            layer_norm_eps=1e-12, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
            initializer_range=0.02, position_embedding_type="absolute")
CONFIGS = {"gpt2": GPT2, "llama": LLAMA, "bert": BERT}


def gpt2_tensors(c: dict) -> dict[str, tuple]:
    d, v = c["n_embd"], c["vocab_size"]
    f = c["n_inner"] or 4 * d  # keras-hub's converter assumes 4 x n_embd
    t = {"transformer.wte.weight": (v, d), "transformer.wpe.weight": (c["n_positions"], d),
         "transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)}
    for i in range(c["n_layer"]):
        p = f"transformer.h.{i}."
        t.update({p + "ln_1.weight": (d,), p + "ln_1.bias": (d,), p + "ln_2.weight": (d,),
                  p + "ln_2.bias": (d,), p + "attn.c_attn.weight": (d, 3 * d),
                  p + "attn.c_attn.bias": (3 * d,), p + "attn.c_proj.weight": (d, d),
                  p + "attn.c_proj.bias": (d,), p + "mlp.c_fc.weight": (d, f),
                  p + "mlp.c_fc.bias": (f,), p + "mlp.c_proj.weight": (f, d),
                  p + "mlp.c_proj.bias": (d,)})
    if not c.get("tie_word_embeddings", True):
        t["lm_head.weight"] = (v, d)
    return t


def llama_tensors(c: dict) -> dict[str, tuple]:
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    n, k = c["num_attention_heads"], c["num_key_value_heads"]
    h = d // n
    t = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": (d,),
                  p + "post_attention_layernorm.weight": (d,),
                  p + "self_attn.q_proj.weight": (n * h, d),
                  p + "self_attn.k_proj.weight": (k * h, d),
                  p + "self_attn.v_proj.weight": (k * h, d),
                  p + "self_attn.o_proj.weight": (d, n * h),
                  p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                  p + "mlp.down_proj.weight": (d, f)})
    if not c.get("tie_word_embeddings", False):
        t["lm_head.weight"] = (v, d)
    return t


def bert_tensors(c: dict, heads=("pooler", "mlm")) -> dict[str, tuple]:
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    e = "bert.embeddings."
    t = {e + "word_embeddings.weight": (v, d),
         e + "position_embeddings.weight": (c["max_position_embeddings"], d),
         e + "token_type_embeddings.weight": (c["type_vocab_size"], d),
         e + "LayerNorm.weight": (d,), e + "LayerNorm.bias": (d,)}
    for i in range(c["num_hidden_layers"]):
        p = f"bert.encoder.layer.{i}."
        for name in ("query", "key", "value"):
            t.update({f"{p}attention.self.{name}.weight": (d, d),
                      f"{p}attention.self.{name}.bias": (d,)})
        t.update({p + "attention.output.dense.weight": (d, d),
                  p + "attention.output.dense.bias": (d,),
                  p + "attention.output.LayerNorm.weight": (d,),
                  p + "attention.output.LayerNorm.bias": (d,),
                  p + "intermediate.dense.weight": (f, d), p + "intermediate.dense.bias": (f,),
                  p + "output.dense.weight": (d, f), p + "output.dense.bias": (d,),
                  p + "output.LayerNorm.weight": (d,), p + "output.LayerNorm.bias": (d,)})
    if "pooler" in heads:
        t.update({"bert.pooler.dense.weight": (d, d), "bert.pooler.dense.bias": (d,)})
    if "mlm" in heads:
        t.update({"cls.predictions.bias": (v,), "cls.predictions.transform.dense.weight": (d, d),
                  "cls.predictions.transform.dense.bias": (d,),
                  "cls.predictions.transform.LayerNorm.weight": (d,),
                  "cls.predictions.transform.LayerNorm.bias": (d,),
                  "cls.predictions.decoder.weight": (v, d)})  # tied copy, as HF stores it
    if "classifier" in heads:
        t.update({"classifier.weight": (c["num_labels"], d), "classifier.bias": (c["num_labels"],)})
    return t


def random_tensors(shapes: dict[str, tuple], seed: int = 0, scale: float = 0.2) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        if name.endswith(("LayerNorm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight",
                          "layernorm.weight", "norm.weight")):
            out[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    if "cls.predictions.decoder.weight" in out:  # tied to the word embeddings
        out["cls.predictions.decoder.weight"] = out["bert.embeddings.word_embeddings.weight"]
    return out


def save_safetensors(tensors: dict, directory: Path, shards: int = 1) -> None:
    """``model.safetensors``, or ``shards`` files and their index, as transformers writes."""
    from safetensors.numpy import save_file

    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    parts = np.array_split(np.arange(len(names)), shards)
    weight_map = {}
    for i, part in enumerate(parts):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        chunk = {names[j]: tensors[names[j]] for j in part}
        save_file(chunk, str(directory / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in chunk})
    total = sum(t.nbytes for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))


def write_checkpoint(directory, family: str, shards: int = 1, seed: int = 0,
                     tensors: dict | None = None, scale: float = 0.2, **config) -> dict:
    """Writes a random ``family`` checkpoint into ``directory``; returns its tensors.
    ``config`` overrides config.json fields; ``tensors`` replaces the weights written;
    ``scale``: the weights' standard deviation (HF initialises with 0.02)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    c = {**CONFIGS[family], **config}
    (directory / "config.json").write_text(json.dumps(c, indent=2))
    if tensors is None:
        shapes = {"gpt2": gpt2_tensors, "llama": llama_tensors, "bert": bert_tensors}[family](c)
        tensors = random_tensors(shapes, seed, scale)
    save_safetensors(tensors, directory, shards)
    return tensors


def assert_loads_sharded(directory: Path, want: np.ndarray, ids: np.ndarray, mesh: str,
                         shard: tuple, tensor: str, reads: int, monkeypatch, out: Path):
    """Loads the MoE checkpoint ``directory`` into a ``GPTCausalLM`` under ``mesh``: its
    logits of ``ids`` are ``want`` (<= 1e-5), block 0's ``moe/gate`` shards have shape
    ``shard``, the tensor whose name ends with ``tensor`` (an expert's) is opened ``reads``
    times — once per box that holds it, never by every device — and the export to ``out``,
    gathered from the shards, is bit-exact to the source's tensors."""
    import keras
    from safetensors.numpy import load_file

    import kdist
    from kdist.models import GPTCausalLM
    from kdist.models.hf import HFCheckpoint

    opened = []
    original = HFCheckpoint.opened
    monkeypatch.setattr(HFCheckpoint, "opened",
                        lambda self, name: opened.append(name) or original(self, name))
    keras.distribution.set_distribution(kdist.distribution(mesh))
    lm = GPTCausalLM.from_pretrained(directory)
    logits = np.asarray(lm.predict_on_batch(ids.astype("int32")))
    np.testing.assert_allclose(logits, want, rtol=0, atol=1e-5)
    gate = next(w for w in lm.weights if w.path.endswith("block_0/moe/gate"))
    assert {s.data.shape for s in gate.value.addressable_shards} == {shard}
    assert sum(name.endswith(tensor) for name in opened) == reads
    lm.save_pretrained(out)
    source, written = (load_file(Path(d) / "model.safetensors") for d in (directory, out))
    assert sorted(source) == sorted(written)
    assert all(np.array_equal(source[k], written[k]) for k in source)

"""Compute waste: XLA's FLOP count of the compiled train step against kdist.flops' formula.

For each preset (deep GPT-2 / Llama shapes reduced in layers so they compile in seconds; the
ratio is per layer, so fewer layers change it only through the embedding share), the
model is built and compiled with AdamW, and ``kdist.planning.xla_train_step_flops`` lowers its
Keras ``train_step`` on abstract inputs and reads ``cost_analysis()["flops"]``. The formula
is ``model_flops_per_token(..., causal_half=False).training x tokens``: matmuls only, the
full ``T x T`` attention matrices — what a dense XLA kernel executes. A ratio above 1 is
work XLA does that the formula does not count (norms, softmax, GELU, loss, optimizer —
estimated in the ``non_matmul`` column) or duplicated/recomputed work (remat rows: expected
1 + blocks' forward / training).

    python benchmarks/compute_waste.py          # ~3-6 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import print_table, run_child, write_result  # noqa: E402

# (row name, preset, backbone overrides, causal LM options, batch, sequence length)
ROWS = [
    ("gpt-nano", "gpt-nano", {}, {}, 8, 256),
    ("gpt-nano remat=block", "gpt-nano", {"remat": "block"}, {}, 8, 256),
    ("gpt-nano remat=save_dots", "gpt-nano", {"remat": "save_dots"}, {}, 8, 256),
    ("gpt-nano fused_qkv", "gpt-nano", {"fused_qkv": True}, {}, 8, 256),
    ("gpt-nano loss_chunk_size=64", "gpt-nano", {}, {"loss_chunk_size": 64}, 8, 256),
    ("llama-nano", "llama-nano", {}, {}, 8, 256),
    ("gpt2-small (2 of 12 layers)", "gpt2-small", {"num_layers": 2}, {}, 2, 1024),
    ("gpt2-medium (2 of 24 layers)", "gpt2-medium", {"num_layers": 2}, {}, 2, 1024),
    ("gpt2-large (1 of 36 layers)", "gpt2-large", {"num_layers": 1}, {}, 1, 1024),
    ("llama-1b (1 of 16 layers, T=1024)", "llama-1b", {"num_layers": 1}, {}, 1, 1024),
]


def non_matmul_estimate(config: dict, batch: int, length: int, params: int) -> float:
    """A rough count of the element-wise FLOPs XLA also counts, per step: ~30 per attention
    probability (mask, max, exp, sum, divide; forward and backward), ~40 per MLP hidden unit
    (GELU/SwiGLU and its gradient), ~30 per logit (softmax cross-entropy and gradient),
    ~20 per hidden value per norm, and ~20 per parameter for AdamW with clipping."""
    tokens = batch * length
    layers, d, heads = config["num_layers"], config["hidden_dim"], config["num_heads"]
    per_token = layers * (30 * heads * length + 40 * config["intermediate_dim"] + 2 * 20 * d)
    per_token += 30 * config["vocabulary_size"] + 20 * d
    return per_token * tokens + 20 * params


def child(args) -> dict:
    import keras

    import kdist

    name, preset, overrides, lm_options, batch, length = next(r for r in ROWS if r[0] == args.row)
    keras.utils.set_random_seed(0)
    lm = kdist.models.GPTCausalLM.from_preset(preset, **lm_options, **overrides)
    lm.compile(optimizer=kdist.optim.adamw())
    xla = kdist.planning.xla_train_step_flops(lm, batch, length)
    flops = kdist.flops.model_flops_per_token(lm, length, causal_half=False)
    formula = flops.training * batch * length
    hardware = flops.hardware * batch * length
    config = lm.backbone.get_config()
    params = lm.count_params()
    return {"row": name, "preset": preset, "overrides": overrides, "options": lm_options,
            "batch": batch, "length": length, "xla_flops": xla, "formula_flops": formula,
            "formula_hardware_flops": hardware, "ratio": xla / formula,
            "ratio_vs_hardware": xla / hardware, "parameters": params,
            "non_matmul_estimate": non_matmul_estimate(config, batch, length, params),
            "convention": flops.convention}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--row", default=None)
    p.add_argument("--rows", nargs="*", default=[r[0] for r in ROWS])
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return None
    rows = []
    for name in args.rows:
        out = run_child(__file__, ["--row", name], tcmalloc=False)
        out["non_matmul_share"] = out["non_matmul_estimate"] / out["formula_flops"]
        rows.append(out)
        print(f"{name}: XLA / formula = {out['ratio']:.4f}", flush=True)
    print_table("Compiled train-step FLOPs (XLA cost_analysis) vs the matmul formula", rows,
                [("row", "row", ""), ("XLA FLOPs", "xla_flops", ".4g"),
                 ("formula", "formula_flops", ".4g"), ("XLA/formula", "ratio", ".4f"),
                 ("XLA/HFU", "ratio_vs_hardware", ".4f"), ("non-matmul est", "non_matmul_share",
                                                         ".4f")])
    for row in rows:
        row["xla_gflop"] = row["xla_flops"] / 1e9
    write_result("compute_waste", {"target": "XLA / formula <= 1.05 without remat",
                                   "rows": rows})
    return rows


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()

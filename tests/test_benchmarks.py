"""The accelerator benchmarks' CPU dry runs: the scripts a TPU or GPU run depends on work
end to end on a tiny shape (Pallas kernels interpreted), and say what they measured."""

import json
import subprocess
import sys

import pytest

from tests.helpers import child_environment

pytestmark = pytest.mark.slow


def _dry_run(tmp_path, script, *args):
    env = child_environment(BENCHMARK_RESULTS=str(tmp_path))
    out = subprocess.run([sys.executable, f"benchmarks/{script}", "--dry-run", *args], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_attention_benchmark_times_every_implementation(tmp_path):
    stdout = _dry_run(tmp_path, "attention.py")
    rows = json.loads((tmp_path / "attention_dry_run.json").read_text())["rows"]
    names = {(r["implementation"], r.get("block_q")) for r in rows if "ms" in r}
    assert {("xla", None), ("chunked", None), ("splash", 128), ("flash", 128)} <= names, rows
    # float32 on a CPU: every implementation computes XLA's attention
    assert max(r["max_diff_vs_xla"] for r in rows if "ms" in r) < 1e-5
    assert "attention forward + backward" in stdout


def test_accelerator_benchmark_compares_the_three_sides(tmp_path):
    stdout = _dry_run(tmp_path, "accelerator.py", "--only", "llama-550m",
                      "--matmul-precision", "int8")
    result = json.loads((tmp_path / "accelerator_dry_run.json").read_text())
    sides = {r["side"]: r for r in result["rows"]}
    assert set(sides) == {"kdist", "kdist int8", "keras-hub", "plain JAX"}, result["rows"]
    int8 = sides.pop("kdist int8")  # same batch, MFU against the int8/bf16 blend (a CPU's
    assert int8["batch"] == sides["kdist"]["batch"]  # measured peak: unchanged)
    assert int8["vs bf16"] == pytest.approx(int8["tokens_per_s"] / sides["kdist"]["tokens_per_s"])
    assert int8["mfu"] == pytest.approx(int8["tflops"] / int8["mfu_peak"])
    ours = sides["kdist"]
    for name in ("keras-hub", "plain JAX"):
        assert ours[f"vs {name}"] == pytest.approx(
            ours["tokens_per_s"] / sides[name]["tokens_per_s"])
    for row in sides.values():  # the compiled step's peak, and MFU from the FLOPs
        assert row["peak_bytes"] > 0 and row["mfu"] > 0
        assert row["tflops"] == pytest.approx(
            row["tokens_per_s"] * ours["flops_per_token"] / 1e12)
    assert "vs keras-hub" in stdout and result["matmul_tflops"] > 0


def test_the_plain_jax_step_with_rematerialised_blocks_trains_the_same():
    # The reference the accelerator benchmark falls back to where no batch of the plain
    # step fits (llama-550m at T = 2048 on a 16 GiB chip): the same losses, recomputed.
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import plain_jax

    config = dict(vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=16,
                  intermediate_dim=32, max_sequence_length=8)
    x = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8)), "int32")
    losses = []
    for remat in (False, True):
        init_state, step = plain_jax.make_step(config, remat=remat)
        state = init_state(plain_jax.init(config, 0))
        for _ in range(2):
            state, loss = step(state, x, x)
        losses.append(float(loss))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_moe_benchmark_compares_kdist_moe_with_keras_hub_mixtral_and_the_dense_model(tmp_path):
    stdout = _dry_run(tmp_path, "moe.py")
    result = json.loads((tmp_path / "moe_dry_run.json").read_text())
    sides = {r["side"]: r for r in result["rows"]}
    assert list(sides) == ["kdist MoE", "keras-hub Mixtral", "kdist dense"], result["rows"]
    ours = sides["kdist MoE"]["tokens_per_s"]
    for row in sides.values():
        assert row["kdist MoE vs this"] == pytest.approx(ours / row["tokens_per_s"])
    # The same shape: keras-hub's Mixtral holds kdist MoE's weights one for one; the dense
    # model holds what a token goes through (2 of 8 experts), without the router.
    shape = result["shape"]
    d, layers = shape["overrides"]["hidden_dim"], shape["overrides"]["num_layers"]
    moe = sides["kdist MoE"]["parameters"]
    assert sides["keras-hub Mixtral"]["parameters"] == moe
    unused = (shape["experts"] - shape["top_k"]) * 3 * d * shape["expert"]
    assert sides["kdist dense"]["parameters"] == moe - layers * (unused + d * shape["experts"])
    assert "kdist MoE vs this" in stdout

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


def test_int8_matmul_benchmark_compares_bf16_kdist_int8_and_reused_codes(tmp_path, monkeypatch):
    # In-process: the dry run's two tiny shapes compile in ~3 s.
    from benchmarks import common, int8_matmul

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    rows = int8_matmul.main(["--dry-run"])
    assert [r["side"] for r in rows[:3]] == ["bf16", "int8 (kdist)", "int8, forward codes reused"]
    assert {r["shape"] for r in rows} == set(int8_matmul.DRY_SHAPES)
    for r in rows:  # every product near float32's: bf16 rounding, or int8's 1/127 steps
        bound = 5e-3 if r["side"] == "bf16" else 3e-2
        assert max(r["error_y"], r["error_dx"], r["error_dw"]) < bound, r
    assert (tmp_path / "int8_matmul_dry_run.json").is_file()


def test_step_profile_classifies_the_ops_of_a_compiled_step():
    from benchmarks.step_profile import classify

    hlo = "\n".join([
        "%fused_int8 (p0: s8[4,8], p1: s8[8,2]) -> s32[4,2] {",
        "  ROOT %convolution.1 = s32[4,2]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf",
        "}",
        "%fused_bf16 (p0: bf16[4,8], p1: bf16[8,2]) -> bf16[4,2] {",
        "  ROOT %convolution.2 = bf16[4,2]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf",
        "}",
        "%fused_codes (p0: bf16[4,8]) -> s8[4,8] {",
        "  %round.1 = f32[4,8]{1,0} round-nearest-even(%p0)",
        "  ROOT %convert.3 = s8[4,8]{1,0} convert(%round.1)",
        "}",
        "%fused_max (p0: bf16[4,8], p1: bf16[]) -> bf16[4] {",
        "  ROOT %reduce.4 = bf16[4]{0} reduce(%p0, %p1), dimensions={1}, to_apply=%max",
        "}",
        "ENTRY %main (a: bf16[4,8], b: s8[8,2], c: bf16[8,2]) -> s32[4,2] {",
        "  %fusion.1 = s8[4,8]{1,0} fusion(%a), kind=kLoop, calls=%fused_codes",
        "  %fusion.2 = bf16[4]{0} fusion(%a, %zero), kind=kInput, calls=%fused_max",
        "  %fusion.3 = bf16[4,2]{1,0} fusion(%a, %c), kind=kOutput, calls=%fused_bf16",
        "  %copy.5 = bf16[8,4]{0,1} copy(%a)",
        "  %custom-call.6 = bf16[4,8]{1,0} custom-call(%a), custom_call_target=\"tpu_custom_call\"",
        "  ROOT %fusion.4 = s32[4,2]{1,0} fusion(%fusion.1, %b), kind=kOutput, calls=%fused_int8",
        "}"])
    kinds = classify(hlo)
    assert {name: kinds[name] for name in ("fusion.1", "fusion.2", "fusion.3", "fusion.4",
                                            "copy.5", "custom-call.6")} == {
        "fusion.1": "quantizers (int8 codes)", "fusion.2": "reduce fusions",
        "fusion.3": "bf16/f32 matmul", "fusion.4": "int8 matmul",
        "copy.5": "copies and layout", "custom-call.6": "kernels (custom calls)"}

"""`kdist plan --device tpu-v5e --devices 256`: a TPU slice planned from this CPU — its HBM,
ICI inside a slice and DCN between slices, and the figures' method said."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kdist.accelerators import NAMES, accelerator, assume
from kdist.cli import main
from kdist.planning import choose_mesh, estimate, mesh_spec, plan
from kdist.planning.target import libtpu_available, resolve, running_links

V5E = accelerator("tpu-v5e")


def test_a_256_chip_v5e_slice_plans_in_seconds_with_its_hbm_and_links(capsys):
    start = time.perf_counter()
    status = main(["plan", "--preset", "gpt2-small", "--device", "tpu-v5e", "--devices", "256",
                   "--global-batch-size", "256", "--sequence-length", "1024",
                   "--precision", "bf16", "--compile", "none"])
    seconds = time.perf_counter() - start
    out = capsys.readouterr().out
    assert status == 0, out
    assert seconds < 15, seconds  # nothing compiled, no 256 host devices started
    lines = out.splitlines()
    assert lines[0] == ("device memory: 16.00 GiB per device (tpu-v5e's HBM per chip, from "
                        "Google Cloud TPU docs, page 'TPU v5e')")
    assert lines[1].startswith("target: tpu-v5e x 256: one slice of 256 chips (ICI inside a "
                               "slice, DCN between: its bytes weigh 64x)")
    assert "ESTIMATED by the analytic cost model, nothing compiled (--compile none)" in lines[1]
    assert "memory per device (ESTIMATED" in out and "compile:" not in out
    # The figure is the estimate's, against v5e's HBM: the verdict uses 16 GiB.
    mesh = next(line for line in lines if line.startswith("plan:")).split("mesh ")[1]
    mesh = mesh.split(" over")[0]
    sizes = {a: int(n) for a, n in (part.split("=") for part in mesh.split(","))}
    with assume("TPU v5 lite"):  # estimated for the chip: what its compiler keeps
        total = estimate("gpt2-small", sizes, 256, 1024, precision="bf16")["total"]
    assert f"verdict: FITS — {total / 2**30:.2f} GiB of 16.00 GiB per device" in out
    # Every axis is on ICI inside the one slice.
    axis_lines = [line for line in lines if line.startswith("    ")]
    assert axis_lines and all(line.endswith("  ICI") for line in axis_lines)


def test_two_slices_put_the_outer_axis_on_dcn_and_auto_weighs_it():
    p = plan("gpt2-small", mesh="data=2,fsdp=256", global_batch_size=512,
             sequence_length=1024, precision="bf16", device="tpu-v5e", num_devices=512,
             compile="none", suggest=False)
    assert p.method == "estimate" and p.device_memory == 16 * 2**30
    assert p.links["axes"] == {"data": "DCN", "fsdp": "ICI"}
    assert p.links["slow_share"] == {"data": 1.0}  # data=2 is exactly the 2 slices
    report = p.report()
    assert "2 slices of 256 chips" in report
    assert "data" in report and "DCN: crosses slices (100% of its bytes)" in report
    # --mesh auto ranks with DCN bytes at 64x (v5e's ICI per chip over its DCN share).
    chosen, rows, why = choose_mesh("gpt2-small", 512, V5E.hbm_bytes, 512, 1024,
                                    precision="bf16", devices_per_host=256,
                                    host_link_slowdown=V5E.link_slowdown(),
                                    boundary="slices")
    assert "bytes between slices 64x" in why
    assert mesh_spec(chosen) == mesh_spec(plan(
        "gpt2-small", mesh="auto", global_batch_size=512, sequence_length=1024,
        precision="bf16", device="tpu-v5e", num_devices=512, compile="none").mesh)


def test_devices_and_slices_are_checked_with_the_flags_named(capsys):
    assert main(["plan", "--device", "tpu-v9", "--devices", "8"]) == 2
    err = capsys.readouterr().err
    assert "--device tpu-v9 is not in kdist's accelerator table. Known: " in err
    assert all(name in err for name in NAMES)
    with pytest.raises(ValueError, match="one tpu-v5e slice holds at most 256"):
        resolve("tpu-v5e", 512, slices=1, compile="none")
    with pytest.raises(ValueError, match="--slices 3 must be a positive divisor"):
        resolve("tpu-v5e", 512, slices=3, compile="none")
    with pytest.raises(ValueError, match="--slices counts TPU slices"):
        resolve("h100", 16, slices=2, compile="none")
    if not libtpu_available():
        with pytest.raises(ValueError, match=r"--compile tpu needs the TPU compiler.*jax\[tpu\]"):
            resolve("tpu-v5e", 256, compile="tpu")
        # auto falls back to the estimate, and says why.
        assert "no TPU compiler here" in resolve("tpu-v5e", 256).how


def test_a_gpu_server_is_its_nvlink_domain():
    t = resolve("h100", 32, compile="none")
    assert (t.link_group, t.fast_link, t.slow_link, t.slowdown) == (8, "NVLink",
                                                                     "InfiniBand", 9.0)
    assert t.device_memory == 80 * 10**9 and t.describe().startswith(
        "h100 x 32: 4 servers of 8 GPUs (NVLink inside a server, InfiniBand between")


# `make test` installs the TPU compiler here (see the Makefile: outside .venv on purpose).
LIBTPU = Path(__file__).parents[2] / ".cache" / "libtpu"

PLAN_ON_V5E = """
import json
from kdist.planning import plan
p = plan("gpt-nano", mesh="fsdp=4", global_batch_size=8, sequence_length=128,
         device="tpu-v5e", num_devices=4, compile="tpu", suggest=False,
         model_overrides={"num_layers": 1, "vocabulary_size": 512})
# One chip: no mesh region around the Pallas attention kernel, which asks JAX's default
# device what it lowers for (the planner names the chip while lowering).
one = plan("gpt-nano", mesh="data=1", global_batch_size=2, sequence_length=128,
           device="tpu-v5e", num_devices=1, compile="tpu", suggest=False,
           model_overrides={"num_layers": 1, "vocabulary_size": 512})
print(json.dumps({"method": p.method, "target": p.target, "memory": p.xla_memory,
                  "total": p.total, "flops": p.flops["xla"], "report": p.report(),
                  "one_chip": [one.method, one.total]}))
"""


def test_the_tpu_compiler_plans_a_v5e_slice_from_this_cpu():
    """`--compile tpu`: libtpu compiles the step for a v5e 2x2 slice on this CPU. In a
    child process with libtpu on its path, so this one keeps its CPU-only JAX."""
    assert libtpu_available() or (LIBTPU / "libtpu").is_dir(), (
        f"the TPU compiler is not installed: `make test` installs it into {LIBTPU} "
        "(or pip install 'jax[tpu]')")
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(LIBTPU),
                                                       os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-c", PLAN_ON_V5E], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    p = json.loads(run.stdout.splitlines()[-1])
    assert p["method"] == "tpu"
    assert "compiled by the TPU compiler (libtpu) for v5e:2x2" in p["target"]
    # The TPU program's own figures: its code is loaded into HBM too (5.7 MiB here), and
    # this small step's temporaries were 0 bytes of HBM when measured.
    m = p["memory"]
    assert m["argument"] > 0 and m["generated_code"] > 0
    assert p["total"] == m["argument"] + m["temp"] + m["output"] - m["alias"] + m["generated_code"]
    assert p["flops"] > 0 and "memory per chip (the TPU compiler's" in p["report"]
    assert p["one_chip"][0] == "tpu" and p["one_chip"][1] > 0


def test_a_run_on_a_tpu_slice_weighs_dcn_at_its_slice_boundary():
    """The recipes' --mesh auto: on a slice ICI spans the hosts, so the boundary is the
    slice's, weighed by the table's ICI/DCN ratio; on CPU hosts, 9x as before."""
    chips = [SimpleNamespace(platform="tpu", device_kind="TPU v5 lite", process_index=i // 4,
                             slice_index=i // 256) for i in range(512)]
    assert running_links(chips) == (256, 64.0, "slices")
    cpus = [SimpleNamespace(platform="cpu", device_kind="cpu", process_index=i // 8)
            for i in range(16)]
    assert running_links(cpus) == (8, 9.0, "hosts")


COMPILED = json.loads((Path(__file__).parents[2] / "benchmarks" / "results" /
                       "tpu_memory_ht.json").read_text())["rows"]


@pytest.mark.parametrize("overrides", [{}, {"scan_layers": True}], ids=["unrolled", "scanned"])
def test_the_estimate_is_within_a_fifth_of_what_the_chips_compiler_needed(overrides):
    # gpt2-small at batch 16 x 1024 in bfloat16 with the attention the chip runs by default
    # (kdist's flash kernel), compiled for a TPU v5e by its own compiler (libtpu, ahead of
    # time: benchmarks/tpu_memory.py): the compiler's heap, what ProgramMemory reports.
    compiled = next(r for r in COMPILED
                    if (r["preset"], r["batch"], r["overrides"]) == ("gpt2-small", 16, overrides))
    assert compiled["attention"] == "flash"
    p = plan("gpt2-small", mesh="data=1", global_batch_size=16, sequence_length=1024,
             precision="bf16", device="tpu-v5e", num_devices=1, compile="none",
             model_overrides=overrides)
    temporaries = p.memory["activations_and_temporaries"] + p.memory["gradients"]
    assert temporaries == pytest.approx(compiled["heap_gib"] * 2**30, rel=0.2)
    assert p.memory["total"] == pytest.approx(compiled["peak_gib"] * 2**30, rel=0.2)
    # The file's estimates are this code's: a change of the cost model regenerates it.
    assert round(temporaries / 2**30, 3) == compiled["estimate_temp_gib"]

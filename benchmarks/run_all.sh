#!/usr/bin/env bash
# Runs every benchmark script, one after the other (they measure ratios within one process;
# running them side by side would add noise). Each prints a small table and writes
# benchmarks/results/<name>.json. Usage, from the repository root:
#   benchmarks/run_all.sh            # or: make bench      (~1 hour on 2 busy CPU cores)
#   PYTHON=.venv/bin/python benchmarks/run_all.sh
# accelerator.py and attention.py run only where JAX sees a TPU or GPU (otherwise their
# CPU dry runs check the plumbing).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TF_CPP_MIN_LOG_LEVEL=2
# What kdist.force_host_devices(8) sets, for scripts that read their devices from the env.
HOST8="--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false"

run() { echo; echo "=== $* ==="; "$@"; }
run "$PYTHON" benchmarks/compute_waste.py
run "$PYTHON" benchmarks/keras_overhead.py
run "$PYTHON" benchmarks/optimisations.py
run "$PYTHON" benchmarks/defaults.py
if "$PYTHON" -c "import torch" 2>/dev/null; then
  run "$PYTHON" benchmarks/peers.py
else
  echo "peers.py skipped: no torch (pip install -e '.[bench]')"
fi
run "$PYTHON" benchmarks/throughput_overhead.py
run env XLA_FLAGS="$HOST8" NPROC=32 "$PYTHON" benchmarks/mesh_step_time.py --out benchmarks/results/mesh_step_time.json
run env XLA_FLAGS="$HOST8" NPROC=32 "$PYTHON" benchmarks/communication.py
run env XLA_FLAGS="$HOST8" NPROC=32 "$PYTHON" benchmarks/memory.py
run "$PYTHON" benchmarks/gradient_reduction.py
run "$PYTHON" benchmarks/pipeline.py bubble
run "$PYTHON" benchmarks/pipeline.py compile   # gpt2-xl: minutes, ~7 GB peak
run "$PYTHON" benchmarks/context_length.py
run "$PYTHON" benchmarks/context_length.py --step-time 4096 --rounds 5
run "$PYTHON" benchmarks/hf_loading.py
run "$PYTHON" benchmarks/moe.py
run "$PYTHON" benchmarks/moe.py --shape mixtral-nano
run "$PYTHON" benchmarks/communicate_less.py --parts bytes error  # its train part: ~1.5 h idle
run "$PYTHON" benchmarks/fault_trials.py --kills 3 --steps 80 --step-sleep 0.5 \
  --json benchmarks/results/fault_trials.json  # the full 10 kills: ~30 min
if "$PYTHON" -c "import jax, sys; sys.exit(jax.devices()[0].platform == 'cpu')" 2>/dev/null; then
  run "$PYTHON" benchmarks/attention.py
  run "$PYTHON" benchmarks/accelerator.py
else
  run "$PYTHON" benchmarks/attention.py --dry-run
  run "$PYTHON" benchmarks/accelerator.py --dry-run
fi
# A TPU v5e step's memory, compiled for the chip here by libtpu (make .cache/libtpu/libtpu).
if [ -d .cache/libtpu/libtpu ]; then
  run env PYTHONPATH=".cache/libtpu:$PYTHONPATH" "$PYTHON" benchmarks/tpu_memory.py
fi

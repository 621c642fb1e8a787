"""The suite's XLA:CPU flags (set by tests/conftest.py, inherited by every child process).

FAST_COMPILE: compile for compile time, not run time: the suite's programs are small and
its time is mostly XLA:CPU compiling them. The first two flags change only the machine code
LLVM emits; the last two make XLA:CPU emit fusions with its older elemental emitter and let
LLVM split a module without inlining it first. Together they cut a tiny GPT's train step
from 2.1-4.1 s to 0.7 s of compilation (1 device) and 2.7-3.8 s to 1.1 s (8 devices).
Every collective (kind, bytes, group), every sharding and every op of the partitioned
program are the same; XLA:CPU groups elementwise ops into fusions differently (372 fusions
against 460 for data=2,fsdp=2,model=2), and float32 results move in the 7th digit, alike
for a sharded run and its 1-device reference. (A key of JAX's cache includes them.)

:func:`for_run_time`: the flags for a child process whose time is running code rather than
compiling it (hundreds of steps, or large batches): XLA's optimisation (level 1) instead.
Measured on 2 cores: a BERT step of 16 x 64 tokens on 8 devices 160 -> 90 ms, its
compilation 4.5 -> 11.8 s; the README's script 105 -> 72 CPU-s.
"""

FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false --xla_llvm_force_inline_before_split=false")


def for_run_time(flags: str) -> str:
    """``flags`` (an XLA_FLAGS value) without FAST_COMPILE's, optimising for run time."""
    fast = {flag.split("=")[0] for flag in FAST_COMPILE.split()}
    kept = [flag for flag in flags.split() if flag.split("=")[0] not in fast]
    return " ".join([*kept, "--xla_backend_optimization_level=1"])

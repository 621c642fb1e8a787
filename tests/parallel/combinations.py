"""The combination table: every mesh and distribution option kdist builds or refuses, as
data, one row a line. ``tests/parallel/test_combinations.py`` runs each row (a row that
trains goes through the parity harness for each of its families; a refused one must fail
with its message before anything compiles), and checks the README's combination matrix
against what the rows show.

A new combination is one more row: ``trains(mesh, families, **distribution_options)`` or
``refused(mesh, message, **distribution_options)``; ``config``/``task`` override the
model's and task's arguments, ``rows``/``steps``/``optimizer``/``tolerance`` the run's.
"""

from __future__ import annotations

import dataclasses

from tests.helpers import TINY_GPT


@dataclasses.dataclass(frozen=True)
class Row:
    mesh: str
    families: tuple[str, ...] = ()
    options: dict = dataclasses.field(default_factory=dict)  # kdist.distribution(...)
    run: dict = dataclasses.field(default_factory=dict)  # the harness' run settings
    refusal: str | None = None  # the regex the ValueError must match; None: it trains
    refuses: tuple[str, str] = ()  # the pair a refusal is about: axes, "reduction", "8-bit"

    @property
    def id(self) -> str:
        """The mesh, then every setting as k=v (a task's and a like-run's spelled out)."""
        settings = {k: v for k, v in {**self.options, **self.run}.items()
                    if k not in ("task", "like", "slow")}
        if isinstance(self.run.get("config"), dict):
            settings.update(settings.pop("config"))
        settings.update(self.run.get("task", {}))
        if "like" in self.run:
            settings["like"] = ",".join(f"{k}={v}" for k, v in self.run["like"].items())
        return "+".join([self.mesh, *(f"{k}={v}" for k, v in settings.items())])

    def settings(self) -> dict:
        """The harness' keyword arguments: run settings, named configs resolved, options."""
        run = dict(self.run)
        if isinstance(run.get("config"), str):
            run["config"] = CONFIGS[run["config"]]
        run.pop("slow", None)
        return {**run, **self.options}


RUN_SETTINGS = ("config", "task", "steps", "rows", "optimizer", "tolerance", "layouts",
                "devices", "slow", "like")


def trains(mesh: str, families: str, **settings) -> Row:
    """``families``: space-separated names of tests/parallel/harness.FAMILIES."""
    run = {k: v for k, v in settings.items() if k in RUN_SETTINGS}
    options = {k: v for k, v in settings.items() if k not in RUN_SETTINGS}
    return Row(mesh, tuple(families.split()), options, run)


def refused(mesh: str, pair: str, message: str, **options) -> Row:
    """``pair``: the two things that do not combine, e.g. ``"stage x seq"``."""
    a, b = pair.split(" x ")
    return Row(mesh, options=options, refusal=message, refuses=(a, b))


CONFIGS = {
    # A deeper GPT, its blocks one scanned stack: 1, 2 or 4 layers per pipeline stage.
    "deep": {**TINY_GPT, "num_layers": 8, "scan_layers": True},
    "scanned": {"scan_layers": True},
}
# DiLoCo's exact special case: inner SGD, every step synchronised, outer lr 1 and no
# momentum is synchronous data-parallel SGD, i.e. one device's SGD.
EXACT_DILOCO = dict(sync_every=1, outer_learning_rate=1.0, outer_momentum=0.0, optimizer="sgd",
                    steps=4)

TABLE: list[Row] = [
    # --- data, fsdp, model: XLA's partitioner reduces the gradients -----------------------
    trains("data=8", "gpt bert", layouts=True),
    trains("fsdp=8", "gpt llama bert hub-gpt2 hub-bert", layouts=True),
    trains("model=2", "hub-gpt2 hub-bert", devices=2, layouts=True, slow=True),
    trains("fsdp=4,model=2", "gpt toy", layouts=True),
    trains("data=2,model=4", "gpt", layouts=True),
    trains("data=4,model=2", "bert", layouts=True),
    trains("model=2,data=-1", "llama"),
    trains("data=2,fsdp=2,model=2", "gpt llama bert", layouts=True),
    trains("data=2,fsdp=2,model=2", "gpt", tolerance="bfloat16"),
    # --- explicit gradient reduction (kdist.parallel.reduction) ---------------------------
    trains("data=8", "gpt", gradient_reduction="float32"),
    trains("fsdp=8", "gpt", gradient_reduction="float32"),
    trains("data=2,fsdp=4", "gpt", gradient_reduction="float32"),
    trains("data=2,fsdp=4", "llama", gradient_reduction="float32", task={"loss_chunk_size": 8}),
    trains("fsdp=8", "gpt", gradient_reduction="float32", config={"attention_chunk_size": 8}),
    trains("fsdp=4,model=2", "gpt", gradient_reduction="float32"),
    trains("fsdp=4,model=2", "bert", gradient_reduction="float32", config={"dropout": 0.1}),
    trains("data=2,fsdp=2,model=2", "gpt", gradient_reduction="float32"),
    # Each device draws its rows of the global dropout mask: the 1-device run's masks.
    trains("data=2,fsdp=2,model=2", "gpt", gradient_reduction="float32",
           config={"dropout": 0.1}),
    # fsdp=8 in bfloat16: tests/parallel/test_reduction.py (that it is not float32's).
    trains("data=2,fsdp=2,model=2", "gpt", gradient_reduction="int8", tolerance="8bit"),
    # float8 with error feedback on data=2,fsdp=4: tests/parallel/test_reduction.py.
    # --- stage: pipelines over a scanned layer stack --------------------------------------
    trains("stage=8", "gpt", config="deep", rows=16),  # 1 layer per stage, M = S = 8
    trains("stage=4,data=2", "gpt", config="deep", rows=16, pipeline_microbatches=8),  # M = 2S
    trains("stage=2,fsdp=2,model=2", "gpt", config="deep", rows=16),
    trains("stage=4,fsdp=2", "gpt", config="deep", rows=16, pipeline_repeats=2),  # circular
    trains("stage=2,data=4", "llama", config="scanned", rows=16, task={"loss_chunk_size": 8}),
    trains("stage=2,data=4", "bert", config="scanned"),
    trains("stage=4,data=2", "gpt", config="deep", rows=16, tolerance="bfloat16"),
    refused("stage=2,data=4", "8-bit x stage", "gradient_reduction='int8' is not built",
            gradient_reduction="int8"),
    refused("stage=2,data=4", "reduction x stage", "gradient_reduction='float32' is not built",
            gradient_reduction="float32"),
    # --- seq: context parallelism (every mesh meets both variants, with and without
    # documents; tests/parallel/test_context.py checks each variant x layout x mask per op)
    trains("seq=8", "gpt llama-documents", context_parallel="all_gather"),
    trains("seq=8", "gpt-documents", context_parallel="ring"),
    trains("seq=8", "llama", context_parallel="ring", gradient_reduction="float32"),
    trains("seq=4,data=2", "gpt llama-documents", context_parallel="ring"),
    trains("seq=4,data=2", "llama", context_parallel="all_gather"),
    trains("seq=4,data=2", "gpt-documents", context_parallel="all_gather",
           gradient_reduction="float32"),
    trains("seq=4,data=2", "gpt", context_parallel="all_gather", gradient_reduction="bfloat16",
           tolerance="bfloat16_gradients"),
    trains("seq=4,data=2", "bert", context_parallel="all_gather"),  # padding masks
    trains("seq=4,data=2", "bert", context_parallel="ring"),
    trains("seq=4,data=2", "llama-documents", context_parallel="ring", config="scanned"),
    trains("seq=4,data=2", "llama", context_parallel="ring", tolerance="bfloat16"),
    trains("seq=2,fsdp=2,model=2", "gpt llama-documents", context_parallel="ring"),
    trains("seq=2,fsdp=2,model=2", "gpt-documents llama", context_parallel="all_gather"),
    trains("seq=2,fsdp=2,model=2", "gpt", context_parallel="ring", gradient_reduction="float32"),
    refused("seq=2,fsdp=4", "8-bit x seq", "gradient_reduction='int8' is not built for a 'seq'",
            gradient_reduction="int8"),
    refused("seq=2,data=4", "8-bit x seq",
            "gradient_reduction='float8' is not built for a 'seq'",
            gradient_reduction="float8", error_feedback=True),
    # --- replica: DiLoCo groups -------------------------------------------------------------
    trains("replica=2,fsdp=4", "gpt", config={"dropout": 0.1}, **EXACT_DILOCO),
    trains("replica=2,data=2,model=2", "gpt", **EXACT_DILOCO),
    trains("replica=2,fsdp=4", "gpt", gradient_reduction="float32", **EXACT_DILOCO),
    # 8-bit codes inside each group: DiLoCo (AdamW inside, H = 2) as with float32 exchange.
    # (8 steps, 4 rounds: the float32 run's loss must move by 10x the 8-bit tolerance.)
    trains("replica=2,data=4", "gpt", gradient_reduction="int8", tolerance="8bit", sync_every=2,
           steps=8, like={"mesh": "replica=2,data=4", "sync_every": 2}),
    # One group with a plain average is plain training: tests/parallel/test_replicas.py.
    # --- axes not (yet) combined with one another -----------------------------------------
    refused("stage=2,seq=2,fsdp=2", "stage x seq", "'seq' axis has not been built or tested"),
    refused("stage=2,replica=2,fsdp=2", "stage x replica",
            r"sync_every=10 \(DiLoCo\) is not built for a 'stage'",
            sync_every=10),
    refused("seq=2,replica=2,fsdp=2", "seq x replica", "'seq' axis has not been built or tested",
            sync_every=10),
    refused("seq=2,fsdp=4", "seq x replica", r"sync_every=5 \(DiLoCo\) is not built for a 'seq'",
            sync_every=5),
]

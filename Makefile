# The two commands of the README:  `make run`  (the main job)  and  `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The recipes run on 8 host (CPU) devices: --host-devices 8 calls kdist.force_host_devices(8)
# (one Eigen thread per device, enough pool threads for their collectives).
HOST8 := --host-devices 8
# The recipes' environment: TensorFlow's start-up lines quiet, and kdist's cache (trained
# tokenizers, token stores, the measured CPU peak) in the project unless KDIST_CACHE is set,
# so `make clean` removes it. A recipe run without make caches in ~/.cache/kdist; the tests
# keep their own (tests/conftest.py).
RECIPE_ENV := TF_CPP_MIN_LOG_LEVEL=2 KDIST_CACHE="$${KDIST_CACHE:-$(CURDIR)/.cache/kdist}"

.PHONY: setup run test test-fast lint clean bench help

setup: $(STAMP)  ## create .venv and install kdist with every extra and the test ones (once; a few minutes)

# pip's own output is the progress of the install (about 4.3 GiB: JAX, Keras, TensorFlow,
# torch; `du -sh .venv`, which tests/test_docs.py holds these figures to).
# `all`: the text pipeline and TFDS (keras-hub, TensorFlow), which the recipes and tests use.
$(STAMP): pyproject.toml
	@echo "Installing kdist and its dependencies into $(VENV) (about 4.3 GiB; a few minutes)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --progress-bar on -e ".[all,test,hf-test]"
	touch $(STAMP)

# EXTRA_ARGS go after ARGS, so they win: tests/test_docs.py runs the README's own
# `make run ARGS="..."` lines as written, with EXTRA_ARGS="--steps 4 ..." from the environment.
run: setup  ## GPT pretraining on the embedded corpus over 8 host devices (ARGS="--steps 50" ...; EXTRA_ARGS after them)
	$(RECIPE_ENV) $(BIN)/python recipes/gpt_pretrain.py $(HOST8) $(ARGS) $(EXTRA_ARGS)

.PHONY: bert-pretrain bert-finetune
bert-pretrain: setup  ## BERT masked-LM pretraining on the embedded corpus (runs/bert_pretrain)
	$(RECIPE_ENV) $(BIN)/python recipes/bert_pretrain.py $(HOST8) $(ARGS)

bert-finetune: setup  ## fine-tune it on the offline stdlib-packages task (runs/bert_finetune)
	$(RECIPE_ENV) $(BIN)/python recipes/bert_finetune.py $(HOST8) $(ARGS)

# The suite compiles mostly on one core at a time: one pytest worker per core (at most 4;
# each holds 8 forced host devices), tests of one multi-process launch on one worker.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, os.cpu_count() or 1))")
# A crashed worker ends the run (--max-worker-restart=0): after replacing one, xdist's
# loadgroup scheduler left the crashed worker's last tests unsent and the run waiting until
# CI's limit (seen 2026-12-05, pytest-xdist 3.8).
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --max-worker-restart=0

# The TPU compiler (libtpu, the version JAX's `tpu` extra names) in a folder of its own, for
# the test that plans a v5e slice ahead of time from this CPU. Not in .venv: there every JAX
# process would first try to open a TPU (and print libtpu's error) before falling back.
LIBTPU := .cache/libtpu
$(LIBTPU)/libtpu: $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps --target $(LIBTPU) "$$($(BIN)/python -c \
	  'import importlib.metadata as m; print(next(r.split(";")[0] for r in m.requires("jax") if r.startswith("libtpu")))')"

test: setup $(LIBTPU)/libtpu  ## the whole test suite (and lint); what CI runs
	$(BIN)/ruff check kdist recipes tests benchmarks
	$(PYTEST) $(PYTEST_ARGS)

test-fast: setup $(LIBTPU)/libtpu  ## the suite without the tests marked slow (for development)
	$(BIN)/ruff check kdist recipes tests benchmarks
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

bench: setup  ## every benchmark script; tables printed, JSON in benchmarks/results/
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	PYTHON=$(BIN)/python benchmarks/run_all.sh

lint: setup  ## ruff on kdist, recipes, tests and benchmarks
	$(BIN)/ruff check kdist recipes tests benchmarks

clean:  ## remove .venv, runs/, pytest's cache and .cache/ (compiled programs, tokenizers)
	rm -rf $(VENV) runs .pytest_cache .cache
	@outside="$${XDG_CACHE_HOME:-$$HOME/.cache}/kdist"; if [ -d "$$outside" ]; then \
	  echo "Left alone: $$outside (kdist's cache for recipes run without make; rm -rf it if you want it gone)"; fi

help:  ## this list: every target and what it does
	@awk -F ':.*## ' '/^[a-zA-Z_-]+:.*## / {printf "  make %-14s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

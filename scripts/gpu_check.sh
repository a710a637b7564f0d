#!/usr/bin/env bash
# One command on a CUDA machine without hub access (about 5-7 minutes on one H200), for random-init Qwen3-0.6B and
# Qwen2.5-1.5B layouts: tokens/s of HF generate, mrl's native and captured decoders at 8, 64 and 256 rows as
# fractions of the bandwidth bound (fails under 90% of greedy rows equal between captured and HF generate); then a few
# bf16 DeepSpeed ZeRO-2 steps of the agent task, full and LoRA r=16 (captured engine, KL on): rollout tokens/s, step
# time, peak GPU memory, finite losses, moving fp32 masters (scripts/gpu_check.py).  Exits 1 without a GPU;
# `--dry-run` measures the engines on CPU on a tiny layout (seconds, no GPU).
#
# Needs torch (CUDA), transformers, deepspeed, hydra-core, omegaconf, typer and rich.  A box that reaches no package
# index takes them as wheels in .whl/ (pip download --no-deps ... on a machine that reaches one); they are installed
# into /tmp/site first.  For a real tokenizer, copy models/smollm2-135m-instruct's tokenizer files (`make smollm2`)
# to models/smollm2-tokenizer/: ~4 MB instead of the model's 0.5 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
exec "$PY" scripts/gpu_check.py "$@"

#!/usr/bin/env bash
# Data parallel on CPU, measured: the same run on 1 and 2 torchrun ranks (gloo, DeepSpeed ZeRO-2), then the
# 2-rank tests (tests/test_distributed.py; SLOW=1 adds the slow ones).  Writes logs and metrics under ${OUT:-out}.
# A box without a package index takes hydra-core, omegaconf, antlr4 and deepspeed as wheels in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES="" PYTHONUNBUFFERED=1
"$PY" -c "import torch, deepspeed, hydra, transformers, typer, rich; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'cores', __import__('os').cpu_count())"
STEPS=${STEPS:-30}
for n in 1 2; do
  rm -rf "$OUT/run$n"; start=$(date +%s%N)
  timeout 300 "$PY" -m torch.distributed.run --standalone --nproc_per_node=$n -m mrl train deepspeed=zero2 \
    trainer.device=cpu trainer.max_steps=$STEPS logger=none hydra.run.dir="$OUT/run$n" > "$OUT/run$n.log" 2>&1
  rc=$?
  echo "ranks=$n rc=$rc wall_ms=$(( ($(date +%s%N) - start) / 1000000 ))"
  "$PY" - "$OUT/run$n/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = [r["perf/step_s"] for r in rows[1:]]
print(f"  steps={len(rows)} rollouts/step={rows[-1]['dapo/rollouts_generated']} median step_s={statistics.median(steps):.3f}"
      f" correctness first5={statistics.mean(r['reward/correctness/mean'] for r in rows[:5]):.2f}"
      f" last5={statistics.mean(r['reward/correctness/mean'] for r in rows[-5:]):.2f}")
PY
done
"$PY" -m pytest --version >/dev/null 2>&1 || "$PY" -m pip install -q --no-index pytest 2>/dev/null
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_distributed.py ${SLOW:+-m ""} 2>&1 | tail -15

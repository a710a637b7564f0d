"""LoRA vs full fine-tuning at the same shape, KL on: peak memory of a training run and bytes of a checkpoint.

    make bench-lora    or    python scripts/bench_lora.py [--model smollm2|tiny] [--ranks 16] [--steps 2] [-- OVERRIDES]

Each configuration trains `--steps` GRPO steps with algo.kl_coef > 0 in its own `mrl train` process (full: a frozen
reference copy; LoRA: the policy with adapters disabled), then the script reads the run's peak memory (`mem/peak_mb`:
peak RSS on CPU, torch.cuda.max_memory_allocated of the step on a GPU) and sizes its last checkpoint against the
model's own weight files.  On CPU it also prints the RSS of a bare process that has imported torch, transformers and
mrl, so that the model-dependent part of each peak can be read off.  Extra arguments after `--` go to every run
(`-- model.dtype=bfloat16 trainer.device=cuda`).

--model smollm2: SmolLM2-135M-Instruct from `make smollm2` (fp32, calc_agent in its chat format, 2 prompts x 4
rollouts x 32 tokens).  --model tiny: the built-in model widened to ~14M parameters (the repro-memory shape).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's mrl, whichever one the interpreter has installed

from mrl.modeling.local_models import SMOLLM2_DIR  # noqa: E402
from mrl.runs.tracking import METRICS_FILE, read_metrics  # noqa: E402

SHAPES = {
    "smollm2": ["rewards=calc_agent", "trainer.prompts_per_step=2", "trainer.group_size=4",
                "trainer.max_new_tokens=32", "trainer.micro_batch_size=8"],
    "tiny": ["model=tiny", "model.tiny.hidden_size=512", "model.tiny.intermediate_size=2048",
             "model.tiny.num_hidden_layers=4", "model.tiny.num_attention_heads=8", "model.tiny.num_key_value_heads=4",
             "trainer.prompts_per_step=4", "trainer.group_size=4", "trainer.micro_batch_size=16"],
}
COMMON = ["algo=grpo", "algo.kl_coef=0.04", "trainer.lr=1e-5", "logger=none", "trainer.save_every=1000"]
# This checkout first, then whatever the caller's PYTHONPATH holds (a GPU box's wheels in /tmp/site, say).
PYTHONPATH = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
# Peak RSS counts what glibc keeps, not only what is alive: with its default (dynamic) mmap threshold, a layer's
# freed temporaries stay stranded in the heap below the tensors saved for the backward, and a checkpointed forward
# measured 1.4 GB of RSS for 0.35 GB of saved tensors.  A fixed, low threshold serves every large tensor by mmap and
# returns it on free, so that a CPU peak is the live memory's (GPU peaks are the allocator's own count anyway).
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "65536"}
BASELINE = ("import resource, torch, transformers, peft, mrl.train.loop; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run(name: str, overrides: list[str], root: Path, threads: int) -> dict:
    run_dir = root / name
    args = ["train", *overrides, f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "mrl.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **ALLOCATOR, "OMP_NUM_THREADS": str(threads),
                               "PYTHONPATH": PYTHONPATH})
    if done.returncode != 0:
        sys.exit(f"{name} failed (exit {done.returncode}): mrl {' '.join(args)}\n{done.stderr[-3000:]}")
    records = read_metrics(run_dir / METRICS_FILE)
    checkpoint = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return {"run": name, "command": "mrl " + " ".join(args), "peak_mb": max(r["mem/peak_mb"] for r in records),
            "checkpoint_bytes": dir_bytes(checkpoint), "wall_s": time.perf_counter() - start,
            "step_s": sum(r["perf/step_s"] for r in records) / len(records), "kl_last": records[-1]["kl"]}


def model_bytes(overrides: list[str]) -> int:
    """Bytes of the model's weight files (model*.safetensors) as it is loaded."""
    from hydra import compose, initialize_config_dir

    from mrl.core.config import CONF_DIR
    from mrl.modeling.models import resolve_model_path

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    return sum(f.stat().st_size for f in Path(resolve_model_path(cfg.model)).glob("model*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(SHAPES), default=None,
                        help="default: smollm2 when `make smollm2` built it, else tiny")
    parser.add_argument("--model-path", default=None, help="SmolLM2's directory (default: models/smollm2-...)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[16])
    parser.add_argument("--steps", type=int, default=2, help="2: the second step holds every phase with the "
                        "optimizer state the first created (the peak of a longer run; one step alone misses it)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench-lora"))
    parser.add_argument("extra", nargs="*", help="overrides for every run, after --")
    args = parser.parse_args()
    smollm2_dir = Path(args.model_path) if args.model_path else SMOLLM2_DIR
    model = args.model or ("smollm2" if (smollm2_dir / "model.safetensors").exists() else "tiny")
    overrides = [*COMMON, *SHAPES[model], f"trainer.max_steps={args.steps}", *args.extra]
    if model == "smollm2":
        overrides = ["model=smollm2_local", f"model.name_or_path={smollm2_dir.resolve()}", *overrides]
    root = args.out / time.strftime("%Y-%m-%d_%H-%M-%S")
    shutil.rmtree(root, ignore_errors=True)
    import torch

    gpu = torch.cuda.is_available() and "trainer.device=cpu" not in args.extra
    # On a GPU the peak is the step's allocated memory: nothing of the bare process is in it.
    baseline = 0.0 if gpu else float(subprocess.run([sys.executable, "-c", BASELINE], capture_output=True,
                                                    text=True, check=True,
                                                    env={**os.environ, **ALLOCATOR, "PYTHONPATH": PYTHONPATH}
                                                    ).stdout)
    weights = model_bytes(overrides)
    rows = [run("full", overrides, root, args.threads)]
    for r in args.ranks:
        rows.append(run(f"lora-r{r}", [*overrides, f"model.lora.r={r}", f"model.lora.alpha={2 * r}"], root,
                        args.threads))
    full = rows[0]
    memory = "torch.cuda.max_memory_allocated" if gpu else f"peak RSS; a bare process: {baseline:.0f} MB"
    lines = [f"model: {model} ({weights / 2**20:.0f} MB of weights), {args.steps} steps, KL on; peak = {memory}", "",
             "| run | peak MB | vs full | above bare process, vs full | checkpoint MB | vs model bytes | s/step |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['run']} | {row['peak_mb']:.0f} | {row['peak_mb'] / full['peak_mb']:.2f} | "
                     f"{(row['peak_mb'] - baseline) / (full['peak_mb'] - baseline):.2f} | "
                     f"{row['checkpoint_bytes'] / 2**20:.1f} | {row['checkpoint_bytes'] / weights:.3f} | "
                     f"{row['step_s']:.1f} |")
    table = "\n".join(lines)
    print(table)
    (root / "bench.md").write_text(table + "\n\n" + "\n".join(r["command"] for r in rows) + "\n")
    (root / "bench.json").write_text(json.dumps({"model": model, "model_bytes": weights, "baseline_mb": baseline,
                                                 "runs": rows}, indent=2) + "\n")
    print(f"\n{root / 'bench.md'}")


if __name__ == "__main__":
    main()

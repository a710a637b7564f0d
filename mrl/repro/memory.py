"""repro-memory: peak memory of one training step for each preset at equal batch.

CPU: the process's peak RSS (each preset in its own process) minus the RSS of the same process before any model
is loaded, next to the model states each preset holds (weights, gradients, Adam moments; frozen weights once).
GPU (SCALE=gpu): torch.cuda.max_memory_allocated during the step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import torch

from mrl.algo.advantages import ESTIMATORS
from mrl.core.config import CONF_DIR
from mrl.modeling.models import load_causal_lm, resolve_model_path
from mrl.repro.common import REPORTS, markdown_table, scale_overrides, write_csv, write_summary
from mrl.repro.plots import pyplot
from mrl.runs.tracking import METRICS_FILE, read_metrics

NAME = "memory"
PRESETS = ["ppo", "grpo", "grpo_weighted", "dapo", "gdpo", "gdpo_conditioned", "gdpo_dapo"]
# A bigger tiny model (~14M parameters) so that model states, not the Python process, dominate the difference.
CPU_MODEL = ["model.tiny.hidden_size=512", "model.tiny.intermediate_size=2048", "model.tiny.num_hidden_layers=4",
             "model.tiny.num_attention_heads=8", "model.tiny.num_key_value_heads=4"]
BASELINE = ("import resource, torch, transformers, mrl.train.loop; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")


def model_state_mb(algo: str, overrides: list[str]) -> float:
    """Weights + gradients + two Adam moments of every trained model, weights of every frozen one, in MB."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"algo={algo}", *overrides])
    policy = load_causal_lm(resolve_model_path(cfg.model), cfg.model, torch.device("cpu"))
    # Float32 masters and moments whatever model.dtype says (mrl/modeling/precision.py); the reference too.
    bytes_per = 4
    params = sum(p.numel() for p in policy.parameters())
    trained = params * (2 if ESTIMATORS[cfg.algo.advantage].needs_critic and cfg.algo.critic == "model"
                        else 1)
    frozen = params if cfg.algo.kl_coef > 0 else 0
    return (4 * trained + frozen) * bytes_per / 2**20


def main() -> None:
    gpu = os.environ.get("SCALE", "cpu") == "gpu"
    overrides = scale_overrides() or CPU_MODEL
    baseline = 0.0 if gpu else float(subprocess.run([sys.executable, "-c", BASELINE], capture_output=True,
                                                    text=True, check=True).stdout)
    rows, commands = [], []
    for preset in PRESETS:
        run_dir = REPORTS / NAME / "runs" / preset
        shutil.rmtree(run_dir, ignore_errors=True)
        args = ["train", f"algo={preset}", "trainer.max_steps=1", "logger=none", *overrides,
                f"hydra.run.dir={run_dir}"]
        commands.append("mrl " + " ".join(args))
        subprocess.run([sys.executable, "-m", "mrl.cli", *args], check=True, capture_output=True)
        peak = read_metrics(run_dir / METRICS_FILE)[-1]["mem/peak_mb"]
        rows.append({"preset": preset, "peak_mb": peak, "above_baseline_mb": peak - baseline,
                     "model_states_mb": model_state_mb(preset, overrides)})
    write_csv(REPORTS / NAME / "memory.csv", rows)

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["above_baseline_mb"] for r in rows], width=0.4, label="measured step peak")
    ax.bar([x + 0.2 for x in xs], [r["model_states_mb"] for r in rows], width=0.4, label="model states")
    ax.set_xticks(list(xs), [r["preset"] for r in rows], rotation=20)
    ax.set_ylabel("MB" + ("" if gpu else " above the bare process"))
    ax.legend()
    fig.tight_layout()
    fig.savefig(REPORTS / NAME / "memory.png", dpi=110)

    ppo = next(r for r in rows if r["preset"] == "ppo")
    grpo = next(r for r in rows if r["preset"] == "grpo")
    ratio = grpo["above_baseline_mb"] / ppo["above_baseline_mb"]
    held = ratio <= 0.65
    write_summary(
        NAME,
        claim="GRPO needs about half of PPO's memory (no critic to train).",
        setup="`make repro-memory`: each preset runs one step in its own process at the same batch "
              "(8 prompts x 8 rollouts):\n\n```\n" + "\n".join(commands) + "\n```\n\n"
              + ("Peak = torch.cuda.max_memory_allocated." if gpu else
                 f"CPU: peak RSS of the process minus {baseline:.0f} MB, the RSS of the same process with the "
                 "libraries imported and no model loaded. Model states = weights, gradients and Adam moments "
                 "(fp32) of each trained model."),
        numbers=markdown_table(list(rows[0]), [list(r.values()) for r in rows]) + "\n\n![memory](memory.png)",
        verdict=(f"GRPO's step used {ratio:.0%} of PPO's memory above the bare process ({grpo['above_baseline_mb']:.0f}"
                 f" vs {ppo['above_baseline_mb']:.0f} MB); in model states alone GRPO holds "
                 f"{grpo['model_states_mb'] / ppo['model_states_mb']:.0%} of PPO's (PPO trains a value model as large "
                 "as the policy)."),
        held=held,
    )
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

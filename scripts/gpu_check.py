"""Does mrl train real-size models on a GPU, in bf16, fast enough, and do they learn?  One command, no hub.

    bash scripts/gpu_check.sh [--steps 3] [--archs qwen3_0_6b qwen2_5_1_5b_instruct] [--out outputs/gpu_check]

For each architecture (Qwen3-0.6B, Qwen2.5-1.5B-Instruct: random weights, mrl/local_models.py) it compares mrl's
native decoder with HF generate (equal tokens, time: `compare_decoders`), then runs
`mrl train model.dtype=bfloat16 deepspeed=zero2` for a few steps of the agent task (GRPO with a KL reference, so the
reference path runs too), prints what metrics.jsonl measured per step (rollout tokens/s, step time, peak GPU
memory, loss, KL), and checks that every loss is finite and that the float32 masters moved: at least 90% of the
layer weights after `steps` updates at lr 1e-5 (in bf16 weights most updates would round away).
The tokenizer is models/smollm2-tokenizer or models/smollm2-135m-instruct (`make smollm2`; the first is its tokenizer
files alone, small enough to copy to a GPU box), else the built-in tiny model's (no chat template).
About 3-4 minutes on one H200, most of it building the random-init models and DeepSpeed's start.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mrl.checkpoint import latest_checkpoint, trained_weights  # noqa: E402
from mrl.config import TinyModelSpec  # noqa: E402
from mrl.local_models import SMOLLM2_DIR, build_random_init  # noqa: E402
from mrl.models import tiny_model_dir  # noqa: E402
from mrl.tracking import METRICS_FILE, read_metrics  # noqa: E402

TOKENIZERS = [ROOT / "models" / "smollm2-tokenizer", ROOT / SMOLLM2_DIR]
PRESETS = {"qwen3_0_6b": "qwen3_0_6b", "qwen2_5_1_5b_instruct": "qwen2_5_1_5b_instruct"}  # arch -> conf/model
MIN_MOVED = 0.9
SHOWN = ["perf/tokens_per_s", "perf/rollout_s", "perf/update_s", "perf/step_s", "mem/peak_mb", "loss/total", "kl"]


def tokenizer_dir() -> tuple[Path, bool]:
    """(a directory with a tokenizer, whether it has a chat template)."""
    for candidate in TOKENIZERS:
        if (candidate / "tokenizer.json").exists():
            return candidate, True
    return tiny_model_dir(TinyModelSpec()), False


def train_overrides(arch: str, model_dir: Path, run_dir: Path, steps: int, chat: bool) -> list[str]:
    return [f"model={PRESETS[arch]}", f"model.name_or_path={model_dir}", "model.dtype=bfloat16",
            f"model.use_chat_template={str(chat).lower()}", "deepspeed=zero2", "algo=grpo", "algo.kl_coef=0.001",
            # random weights rarely tell rollouts apart: the entropy bonus gives every step a gradient
            "algo.entropy_coef=0.001", f"trainer.max_steps={steps}", f"trainer.save_every={steps}",
            "trainer.prompts_per_step=8", "trainer.group_size=8", "trainer.max_new_tokens=64", "trainer.lr=1e-5",
            "trainer.micro_batch_size=16", "trainer.device=cuda", "logger=none", f"hydra.run.dir={run_dir}"]


def moved_fraction(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """The share of transformer-block weights that differ (embeddings and the head aside)."""
    keys = [k for k in before if ".layers." in k]
    changed = sum(int((before[k].float() != after[k].float()).sum()) for k in keys)
    return changed / sum(before[k].numel() for k in keys)


def check_run(run_dir: Path, model_dir: Path) -> list[str]:
    """What went wrong in a finished run (empty: nothing): a non-finite loss, masters that did not move."""
    from safetensors.torch import load_file

    records = read_metrics(run_dir / METRICS_FILE)
    problems = [f"step {r['step']}: loss/total={r['loss/total']}" for r in records
                if r["loss/total"] is None or not math.isfinite(r["loss/total"])]
    initial = {f"policy.{k}": v for k, v in load_file(model_dir / "model.safetensors").items()}
    moved = moved_fraction(initial, trained_weights(latest_checkpoint(run_dir)))
    print(f"  masters moved: {moved:.1%} of the layer weights")
    if moved < MIN_MOVED:
        problems.append(f"only {moved:.1%} of the layer weights moved (want >= {MIN_MOVED:.0%})")
    return problems


def compare_decoders(model_dir: Path, device: torch.device, dtype: str = "bfloat16", rows: int = 32,
                     tokens: int = 64) -> list[str]:
    """mrl's native decoder against HF generate on `model_dir`, loaded as `mrl train` loads a policy (float32
    weights, `dtype` autocast on a GPU), on `rows` random left-padded prompts of 48 tokens sharing 8 prompts' cache:
    the share of rows whose tokens are equal (greedy, and sampled with one seed and HF's draw, `multinomial`) and each
    one's decode time, and, sampled on a CPU, the time with the native decoder's own draw there (`inverse_cdf`).
    Prints them; returns what went wrong (under 90% equal rows: a real difference, not a rounding one, on a GPU
    whose kernels may round differently from the CPU, where every row is equal)."""
    from mrl.config import ModelConfig
    from mrl.decoder import draw_for, multinomial
    from mrl.models import load_causal_lm
    from mrl.rollout import Sampling, hf_decode, native_decode, prompt_cache

    model = load_causal_lm(str(model_dir), ModelConfig(name_or_path=str(model_dir), dtype=dtype), device).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, model.config.vocab_size, (8, 48), generator=generator).to(device)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[:4, :5] = 0  # left padding
    prompt_rows = torch.arange(rows, device=device) * 8 // rows
    ids, mask = prompts[prompt_rows], prompt_mask[prompt_rows]
    cache = prompt_cache(model, prompts, prompt_mask)  # each prompt but its last token; neither decoder changes it
    native_hf_draw = functools.partial(native_decode, draw=multinomial)
    problems = []
    for name, sampling in (("greedy", Sampling(tokens, greedy=True)), ("sampled", Sampling(tokens))):
        outputs, seconds = [], []
        own_draw = not sampling.greedy and draw_for(device) is not multinomial  # a CPU's: time it too
        for decode in (native_hf_draw, hf_decode) + ((native_decode,) if own_draw else ()):
            torch.manual_seed(0)
            start = time.perf_counter()
            outputs.append(decode(model, ids, mask, cache, prompt_rows, sampling, tokens, [1], 0, None))
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        equal = (outputs[0] == outputs[1]).all(1).float().mean().item()
        own_time = f", with its own draw {seconds[2]:.2f} s" if own_draw else ""
        print(f"  decoders, {name}, {rows} rows x {tokens} tokens: {equal:.0%} of rows equal; native "
              f"{seconds[0]:.2f} s{own_time}, HF generate {seconds[1]:.2f} s")
        if equal < 0.9:
            problems.append(f"native decoder, {name}: only {equal:.0%} of rows equal HF generate's")
    return problems


def print_metrics(run_dir: Path) -> None:
    print("  step | " + " | ".join(SHOWN))
    for record in read_metrics(run_dir / METRICS_FILE):
        cells = ["-" if record.get(k) is None else f"{record[k]:.4g}" for k in SHOWN]
        print(f"  {record['step']:4d} | " + " | ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--archs", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "gpu_check")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device is visible (torch.cuda.is_available() is False); run it on a GPU machine "
                 "with a CUDA build of torch")
    print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 "
          f"{torch.cuda.is_bf16_supported()}")
    tokenizer, chat = tokenizer_dir()
    print(f"tokenizer: {tokenizer}" + ("" if chat else " (the built-in tiny one: no chat template)"))
    problems = []
    for arch in args.archs:
        start = time.perf_counter()
        model_dir = build_random_init(arch, tokenizer, args.out / "models" / arch)
        print(f"\n{arch}: model dir {model_dir} ({time.perf_counter() - start:.0f} s)")
        problems += [f"{arch}: {p}" for p in compare_decoders(model_dir, torch.device("cuda"))]
        run_dir = args.out / "runs" / arch
        shutil.rmtree(run_dir, ignore_errors=True)  # this check's own previous run
        start = time.perf_counter()
        command = [sys.executable, "-m", "mrl.cli", "train",
                   *train_overrides(arch, model_dir, run_dir, args.steps, chat)]
        print("  $ " + " ".join(command[1:]))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        print(f"  mrl train: exit {done.returncode} after {time.perf_counter() - start:.0f} s")
        if done.returncode != 0:
            print(done.stdout[-3000:] + done.stderr[-3000:])
            problems.append(f"{arch}: mrl train failed")
            continue
        print_metrics(run_dir)
        problems += [f"{arch}: {p}" for p in check_run(run_dir, model_dir)]
    print("\n" + ("gpu_check: OK" if not problems else "gpu_check: FAILED\n  " + "\n  ".join(problems)))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()

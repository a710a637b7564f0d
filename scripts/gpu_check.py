"""Does mrl train real-size models on a GPU, in bf16, fast enough, and do they learn?  One command, no hub.

    bash scripts/gpu_check.sh [--steps 3] [--archs qwen3_0_6b qwen2_5_1_5b_instruct] [--out outputs/gpu_check]
                              [--rows 8 64 256] [--tokens 64] [--lora-rank 16] [--dry-run]

For each architecture (Qwen3-0.6B, Qwen2.5-1.5B-Instruct: random weights, mrl/modeling/local_models.py) it measures the
rollout engines (`measure_engines`: tokens/s of HF generate, the native decoder and the captured one at 8, 64 and
256 rows, each as a fraction of the bandwidth bound, rows x measured copy bandwidth / weight bytes; fails where the
captured decoder's greedy rows equal HF generate's on under 90%; `measure_vllm`: vLLM's, where it is installed,
with `make install-vllm`'s CUDA build, in the same table), compares mrl's
native decoder with HF generate (equal tokens, time: `compare_decoders`), then runs
`mrl train model.dtype=bfloat16 deepspeed=zero2` for a few steps of the agent task (GRPO with a KL reference, so the
reference path runs too), prints what metrics.jsonl measured per step (rollout tokens/s, step time, peak GPU
memory, loss, KL), and checks that every loss is finite and that the float32 masters moved: at least 90% of the
layer weights after `steps` updates at lr 1e-5 (in bf16 weights most updates would round away).
The tokenizer is models/smollm2-tokenizer or models/smollm2-135m-instruct (`make smollm2`; the first is its tokenizer
files alone, small enough to copy to a GPU box), else the built-in tiny model's (no chat template).
Then, with `--lora-rank` > 0, the same run with LoRA adapters of that rank and `rollout.engine=captured`: its step
time and peak memory (KL on).  About 5-7 minutes on one H200, most of it building the random-init models and
DeepSpeed's starts.  `--dry-run` measures the engines alone, on CPU, on a tiny layout of 2 rows (seconds: the smoke
test of this script's Python, tests/test_captured_gpu_check.py).
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

from mrl.core.config import TinyModelSpec  # noqa: E402
from mrl.modeling.local_models import SMOLLM2_DIR, build_random_init  # noqa: E402
from mrl.modeling.models import tiny_model_dir  # noqa: E402
from mrl.runs.checkpoint import latest_checkpoint  # noqa: E402
from mrl.runs.restore import trained_weights  # noqa: E402
from mrl.runs.tracking import METRICS_FILE, read_metrics  # noqa: E402

TOKENIZERS = [ROOT / "models" / "smollm2-tokenizer", ROOT / SMOLLM2_DIR]
PRESETS = {"qwen3_0_6b": "qwen3_0_6b", "qwen2_5_1_5b_instruct": "qwen2_5_1_5b_instruct"}  # arch -> conf/model
MIN_MOVED = 0.9
MIN_EQUAL = 0.9  # captured vs HF generate, greedy: rows equal (bf16 kernels may round a near-tie the other way)
DRY_LAYOUT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512)  # --dry-run: seconds on a CPU
SHOWN = ["perf/tokens_per_s", "perf/rollout_s", "perf/update_s", "perf/step_s", "mem/peak_mb", "loss/total", "kl"]


def tokenizer_dir() -> tuple[Path, bool]:
    """(a directory with a tokenizer, whether it has a chat template)."""
    for candidate in TOKENIZERS:
        if (candidate / "tokenizer.json").exists():
            return candidate, True
    return tiny_model_dir(TinyModelSpec()), False


def train_overrides(arch: str, model_dir: Path, run_dir: Path, steps: int, chat: bool, lora_rank: int = 0) -> list[str]:
    """`mrl train`'s overrides for `arch`; with `lora_rank` > 0, LoRA adapters of that rank decoded by the captured
    engine (the full run keeps `rollout.engine=auto`, which picks by measurement)."""
    lora = [f"model.lora.r={lora_rank}", f"model.lora.alpha={2 * lora_rank}", "rollout.engine=captured"] \
        if lora_rank else []
    return [*lora, f"model={PRESETS[arch]}", f"model.name_or_path={model_dir}", "model.dtype=bfloat16",
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
    from mrl.core.config import ModelConfig
    from mrl.generation.decoder import DecodeRequest, draw_for, multinomial
    from mrl.generation.rollout import Sampling, hf_decode, native_decode, prompt_cache
    from mrl.modeling.models import load_causal_lm

    model = load_causal_lm(str(model_dir), ModelConfig(name_or_path=str(model_dir), dtype=dtype), device).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, model.config.vocab_size, (8, 48), generator=generator).to(device)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[:4, :5] = 0  # left padding
    prompt_rows = torch.arange(rows, device=device) * 8 // rows
    ids, mask = prompts[prompt_rows], prompt_mask[prompt_rows]
    cache = prompt_cache(model, prompts, prompt_mask)  # each prompt but its last token; neither decoder changes it
    request = DecodeRequest(ids, mask, tokens, [1], 0, cache, prompt_rows)
    native_hf_draw = functools.partial(native_decode, draw=multinomial)
    problems = []
    for name, sampling in (("greedy", Sampling(tokens, greedy=True)), ("sampled", Sampling(tokens))):
        outputs, seconds = [], []
        own_draw = not sampling.greedy and draw_for(device) is not multinomial  # a CPU's: time it too
        for decode in (native_hf_draw, hf_decode) + ((native_decode,) if own_draw else ()):
            torch.manual_seed(0)
            start = time.perf_counter()
            outputs.append(decode(model, request, sampling))
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


def layout_model(arch: str, device: torch.device, **overrides):
    """A random-init model of `arch`'s layout (mrl.modeling.local_models.ARCHITECTURES, `overrides` shrinking it) built
    from its config, no download, no tokenizer: bf16 weights on a GPU (as DeepSpeed's bf16 mode holds them), float32 on
    a CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mrl.modeling.local_models import ARCHITECTURES

    config = AutoConfig.for_model(**{**ARCHITECTURES[arch], **overrides}, pad_token_id=0, eos_token_id=1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()


def copy_bandwidth(device: torch.device, nbytes: int = 2 ** 30) -> float:
    """Bytes per second a copy of `nbytes` within `device` moves (each byte read once and written once: 2 x nbytes
    per copy), the best of 5."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = math.inf
    for _ in range(6):  # the first one warms up
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_engines(model, device: torch.device, rows_list: tuple[int, ...] = (8, 64, 256), tokens: int = 64,
                    prompt: int = 64, bandwidth: float | None = None) -> tuple[list[dict], list[str]]:
    """Tokens/s of HF generate, the native decoder and the captured one on `model` (sampled at temperature 1 with
    HF's draw, no row stopping, `prompt` tokens of random prompts each, half left-padded by 5; the timed call is the
    second, the first warming up and capturing), each as a fraction of the bandwidth bound: rows x `bandwidth`
    (measured when None) / the weights' bytes, the tokens/s at which each step reads the weights once (KV reads,
    the prompt and sampling left out: the bound is generous).  Also the share of greedy rows where the captured
    decoder's tokens are HF generate's.  -> (one dict per rows and engine, what went wrong: under MIN_EQUAL)."""
    from mrl.generation.decoder import DecodeRequest, multinomial
    from mrl.generation.rollout import Sampling, captured_decode, hf_decode, native_decode

    engines = {"hf": hf_decode, "native": functools.partial(native_decode, draw=multinomial),
               "captured": functools.partial(captured_decode, draw=multinomial)}
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = bandwidth or copy_bandwidth(device)
    vocab = model.config.vocab_size
    stop_ids, pad = [vocab], 0  # no token stops: every row decodes `tokens`
    results, problems = [], []
    for rows in rows_list:
        generator = torch.Generator().manual_seed(rows)
        ids = torch.randint(2, vocab, (rows, prompt), generator=generator).to(device)
        mask = torch.ones_like(ids)
        mask[: rows // 2, :5] = 0
        ids = ids.masked_fill(mask == 0, pad)
        request, greedy = DecodeRequest(ids, mask, tokens, stop_ids, pad), Sampling(tokens, greedy=True)
        expected, computed = (decode(model, request, greedy) for decode in (hf_decode, engines["captured"]))
        equal = (expected == computed).all(1).float().mean().item()
        if equal < MIN_EQUAL:
            problems.append(f"captured decoder, {rows} rows greedy: only {equal:.0%} of rows equal HF generate's "
                            f"(want >= {MIN_EQUAL:.0%})")
        for name, decode in engines.items():
            for _ in range(2):  # warm-up (the captured decoder's capture), then timed
                torch.manual_seed(0)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                synchronize(device)
                start = time.perf_counter()
                out = decode(model, request, Sampling(tokens))
                synchronize(device)
                seconds = time.perf_counter() - start
            generated = rows * (out.shape[1] - prompt)
            peak = torch.cuda.max_memory_allocated() / 2 ** 20 if device.type == "cuda" else None
            results.append({"rows": rows, "engine": name, "tokens_per_s": generated / seconds, "seconds": seconds,
                            "bound_fraction": generated / seconds / (rows * bandwidth / weights), "peak_mb": peak,
                            "greedy_equal": equal if name == "captured" else None})
    return results, problems


def measure_vllm(model, tokenizer_path: Path, device: torch.device, rows_list: tuple[int, ...] = (8, 64, 256),
                 tokens: int = 64, prompt: int = 64, bandwidth: float | None = None) -> list[dict]:
    """`measure_engines`' measurement of vLLM: the sampler `rollout.engine=vllm` starts (mrl.generation.vllm_engine,
    from `model`'s weights, in their dtype), on the same random prompts, sampled at temperature 1, every row decoding
    `tokens` (`ignore_eos`, nothing detokenized: `model`'s vocabulary need not be the tokenizer's); the timed call is
    the second.  [] where vLLM is not importable, said in one line (`make install-vllm` installs it)."""
    from mrl.generation.vllm_engine import VllmSampler, VllmSettings, missing
    from mrl.modeling.models import load_tokenizer

    if missing() is not None:
        print(f"  vllm: not measured ({missing()}: make install-vllm)")
        return []
    from vllm import SamplingParams

    tokenizer = load_tokenizer(str(tokenizer_path))
    settings = VllmSettings(max_model_len=prompt + tokens, kv_cache_gb=4.0, gpu_memory_utilization=0.3, sleep=False)
    sampler = VllmSampler(model, tokenizer, device, settings, next(model.parameters()).dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = bandwidth or copy_bandwidth(device)
    vocab = min(model.config.vocab_size, len(tokenizer))  # ids both the model and vLLM's prompt check accept
    params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, detokenize=False, seed=0)
    results = []
    try:
        for rows in rows_list:
            generator = torch.Generator().manual_seed(rows)
            prompts = [{"prompt_token_ids": row} for row in torch.randint(2, vocab, (rows, prompt),
                                                                          generator=generator).tolist()]
            for _ in range(2):  # warm-up, then timed
                start = time.perf_counter()
                outputs = sampler.llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
            generated = sum(len(output.outputs[0].token_ids) for output in outputs)
            results.append({"rows": rows, "engine": "vllm", "tokens_per_s": generated / seconds, "seconds": seconds,
                            "generated": generated, "peak_mb": None, "greedy_equal": None,
                            "bound_fraction": generated / seconds / (rows * bandwidth / weights)})
    finally:
        sampler.close()
    return results


def print_engines(arch: str, results: list[dict]) -> None:
    """The measured table, as docs/gpu.md shows it."""
    print("  | layout | rows | engine | tokens/s | of the bound | x HF generate | peak MiB | greedy rows = HF |")
    print("  |---|---|---|---|---|---|---|---|")
    hf = {r["rows"]: r["tokens_per_s"] for r in results if r["engine"] == "hf"}
    for r in results:
        equal = "" if r["greedy_equal"] is None else f"{r['greedy_equal']:.0%}"
        peak = "-" if r["peak_mb"] is None else f"{r['peak_mb']:,.0f}"
        print(f"  | {arch} | {r['rows']} | {r['engine']} | {r['tokens_per_s']:,.0f} | {r['bound_fraction']:.1%} | "
              f"{r['tokens_per_s'] / hf[r['rows']]:.1f} | {peak} | {equal} |")


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
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--lora-rank", type=int, default=16, help="0: no LoRA run")
    parser.add_argument("--dry-run", action="store_true", help="the engines alone on CPU, a tiny layout, 2 rows")
    args = parser.parse_args()
    if args.dry_run:
        sys.exit(dry_run(args.archs))
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device is visible (torch.cuda.is_available() is False); run it on a GPU machine "
                 "with a CUDA build of torch")
    print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 "
          f"{torch.cuda.is_bf16_supported()}")
    tokenizer, chat = tokenizer_dir()
    print(f"tokenizer: {tokenizer}" + ("" if chat else " (the built-in tiny one: no chat template)"))
    problems = []
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"device copy bandwidth: {bandwidth / 1e12:.2f} TB/s (read + write of 1 GiB, best of 5)")
    for arch in args.archs:
        start = time.perf_counter()
        model_dir = build_random_init(arch, tokenizer, args.out / "models" / arch)
        print(f"\n{arch}: model dir {model_dir} ({time.perf_counter() - start:.0f} s)")
        device = torch.device("cuda")
        model = layout_model(arch, device)
        results, engine_problems = measure_engines(model, device, tuple(args.rows), args.tokens,
                                                   bandwidth=bandwidth)
        results += measure_vllm(model, tokenizer, device, tuple(args.rows), args.tokens, bandwidth=bandwidth)
        del model
        torch.cuda.empty_cache()
        print_engines(arch, results)
        problems += [f"{arch}: {p}" for p in engine_problems]
        problems += [f"{arch}: {p}" for p in compare_decoders(model_dir, device)]
        for lora_rank in (0, args.lora_rank) if args.lora_rank else (0,):
            problems += [f"{arch}: {p}" for p in train_run(arch, model_dir, args.out, args.steps, chat, lora_rank)]
    print("\n" + ("gpu_check: OK" if not problems else "gpu_check: FAILED\n  " + "\n  ".join(problems)))
    sys.exit(1 if problems else 0)


def train_run(arch: str, model_dir: Path, out: Path, steps: int, chat: bool, lora_rank: int) -> list[str]:
    """`mrl train` on `arch` in its own process (LoRA of `lora_rank` when > 0): prints its metrics per step (rollout
    tokens/s, step time, peak GPU memory); returns what went wrong (the masters checked on the full run only)."""
    run_dir = out / "runs" / (arch + (f"-lora{lora_rank}" if lora_rank else ""))
    shutil.rmtree(run_dir, ignore_errors=True)  # this check's own previous run
    start = time.perf_counter()
    command = [sys.executable, "-m", "mrl.cli", "train",
               *train_overrides(arch, model_dir, run_dir, steps, chat, lora_rank)]
    print("  $ " + " ".join(command[1:]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    print(f"  mrl train: exit {done.returncode} after {time.perf_counter() - start:.0f} s")
    print("  " + "\n  ".join(line for line in done.stderr.splitlines() if "rollout.engine=" in line))
    if done.returncode != 0:
        print(done.stdout[-3000:] + done.stderr[-3000:])
        return ["mrl train failed" + (f" (LoRA r={lora_rank})" if lora_rank else "")]
    print_metrics(run_dir)
    if lora_rank:
        records = read_metrics(run_dir / METRICS_FILE)
        return [f"LoRA step {r['step']}: loss/total={r['loss/total']}" for r in records
                if r["loss/total"] is None or not math.isfinite(r["loss/total"])]
    return check_run(run_dir, model_dir)


def dry_run(archs: list[str]) -> int:
    """The engines' measurement on CPU, each arch's layout shrunk to DRY_LAYOUT, 2 rows x 8 tokens: this script's
    Python runs without a GPU.  -> the exit code."""
    device = torch.device("cpu")
    problems = []
    for arch in archs:
        results, engine_problems = measure_engines(layout_model(arch, device, **DRY_LAYOUT), device, (2,), 8,
                                                   prompt=16, bandwidth=copy_bandwidth(device, 2 ** 24))
        print_engines(arch, results)
        problems += [f"{arch}: {p}" for p in engine_problems]
    print("gpu_check --dry-run: " + ("OK" if not problems else "FAILED\n  " + "\n  ".join(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    main()

"""Held-out evaluation: one function scores held-out prompts (`score_held_out`), for the curve a run logs while it
trains (`trainer.eval_every`: eval/... in metrics.jsonl) and for `mrl eval` (a run's newest intact checkpoint, or a
base model with `--model DIR`, which write eval.json and eval.jsonl).

Each prompt gets one greedy episode and, with `samples` > 0, that many sampled ones.  An episode passes when the
channel `rewards.pass_channel` is >= 1.0 on it (an abstention or a failed channel does not pass); accuracy is the
share of prompts whose greedy episode passes, and pass@k is the unbiased estimator of Chen et al. 2021
(arXiv:2107.03374, Eq. 1) on each prompt's sampled episodes, averaged over prompts.
"""

from __future__ import annotations

import json
import math
import random
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import Tensor

from mrl.core.config import CONF_DIR, UserError
from mrl.core.episode import Prompt
from mrl.envs.task import Task, build_task, episode_protocol, held_out_prompts
from mrl.generation.rollout import ROLLOUT_ENGINES, RolloutEngine, Rollouts, Sampling
from mrl.modeling import fits
from mrl.modeling.lora import is_adapter_dir
from mrl.modeling.models import BUILTIN_TINY, load_causal_lm, load_tokenizer, quiet_transformers, resolve_model_path
from mrl.modeling.trainable import pick_device
from mrl.rewards.channels import RewardSet, build_reward_set
from mrl.runs.restore import adapter_base, load_for_inference
from mrl.runs.rundir import atomic_write_jsonl, atomic_write_text, check_writable, disk_faults, intact_checkpoint
from mrl.runs.trust import run_config
from mrl.train.batch import StepBatch
from mrl.train.validation import validate

EVAL_FILE = "eval.json"
EVAL_LINES = "eval.jsonl"  # one line per held-out prompt: its greedy transcript, each channel's value, passed
EVAL_OUTCOMES = "outcomes.jsonl"  # mrl eval's outcome_rows: one line per prompt and episode, as held_out/ keeps them
HELD_OUT_DIR = "held_out"  # in a run dir: step_<N>.jsonl, each evaluation's outcomes per record and episode
PASS_VALUE = 1.0  # an episode passes when rewards.pass_channel is at least this (BFCL correctness 1, pass_rate 1)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k episodes drawn without replacement from n, of which c pass, passes:
    1 - C(n-c, k) / C(n, k) (Chen et al. 2021, Eq. 1), exact in integers.

    >>> [pass_at_k(4, 1, k) for k in (1, 2, 3, 4)]
    [0.25, 0.5, 0.75, 1.0]
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): needs 0 <= c <= n and 1 <= k <= n")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(samples: int) -> list[int]:
    """The k reported for `samples` episodes per prompt: 1, 2, 4, ... up to `samples` (none for 0).

    >>> pass_ks(5), pass_ks(0)
    ([1, 2, 4], [])
    """
    return [2 ** i for i in range(samples.bit_length()) if 2 ** i <= samples]


@dataclass
class HeldOut:
    """P held-out prompts, scored: one greedy episode each, and S sampled ones each (rows p*S .. p*S+S-1)."""

    prompts: list[Prompt]
    names: list[str]  # the channels, in the rewards' column order
    greedy: StepBatch  # P episodes; rewards [P, K] (NaN: abstained or failed)
    sampled: StepBatch | None  # P*S episodes, rewards [P*S, K]; None when S = 0
    samples: int  # S


def score_held_out(engine: RolloutEngine, prompts: list[Prompt], sampling: Sampling, samples: int, protocol,
                   reward_set: RewardSet, batch_tokens: int) -> HeldOut:
    """Generate and score the held-out episodes: greedy (one per prompt) and, with `samples` > 0, sampled per
    `sampling` (the training's temperature, top_p, top_k: pass@k of the distribution the run samples from).  A
    failing channel is recorded (NaN), not raised: an evaluation must not stop a training run.

    Generated in chunks (`in_chunks`) of at most `batch_tokens` rows x (prompt + max_new_tokens) tokens, prompts of
    like length together: the KV cache, the memory that grows with the rows, is bounded by the budget whatever the
    number of prompts, and short prompts are not padded to the longest."""
    greedy = StepBatch.scored(in_chunks(engine, prompts, 1, replace(sampling, greedy=True), protocol, batch_tokens),
                       reward_set, "drop")
    sampled = None
    if samples > 0:
        sampled = StepBatch.scored(in_chunks(engine, prompts, samples, replace(sampling, greedy=False), protocol,
                                             batch_tokens), reward_set, "drop")
    return HeldOut(prompts, list(reward_set.names), greedy, sampled, samples)


@dataclass(frozen=True)
class HeldOutSettings:
    """A training run's held-out evaluation, built once from the config (`of`): `prompts` held-out prompts, each
    scored greedy and `samples` times sampled per `sampling`, `batch_tokens` a generate call, on an RNG seeded with
    `seed`; `pass_channel` says which episodes pass."""

    prompts: int  # trainer.eval_prompts
    samples: int  # trainer.eval_samples
    batch_tokens: int  # trainer.eval_batch_tokens
    seed: int  # trainer.seed
    sampling: Sampling  # trainer.max_new_tokens, temperature, top_p, top_k
    pass_channel: str | None  # rewards.pass_channel

    @staticmethod
    def of(cfg, sampling: Sampling) -> HeldOutSettings:
        trainer = cfg.trainer
        return HeldOutSettings(trainer.eval_prompts, trainer.eval_samples, trainer.eval_batch_tokens, trainer.seed,
                               sampling, cfg.rewards.pass_channel)


def held_out_metrics(settings: HeldOutSettings, engine: RolloutEngine, task: Task, protocol, reward_set: RewardSet,
                     device: torch.device, whole, outcomes: Path | None = None) -> dict[str, Any]:
    """A training run's held-out evaluation (`mrl train`, `mrl sft`): held-out prompts of `task` scored per
    `settings`, inside `whole()` (the weights whole: ZeRO-3) and on a separate RNG -> eval/... metrics and
    perf/eval_s; with `outcomes` (rank 0's <run dir>/held_out/step_<N>.jsonl), every episode's channel values written
    there (`outcome_rows`: the paired comparison's unit)."""
    start = time.perf_counter()
    prompts = nonempty_held_out(task, settings.prompts)
    with separate_rng(settings.seed, device), whole():
        held = score_held_out(engine, prompts, settings.sampling, settings.samples, protocol, reward_set,
                              settings.batch_tokens)
    if outcomes is not None:
        outcomes.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_jsonl(outcomes, outcome_rows(held))
    return {**eval_metrics(summarize(held, settings.pass_channel)), "perf/eval_s": time.perf_counter() - start}


def length_chunks(lengths: list[int], per_row: int, group_size: int, batch_tokens: int) -> list[list[int]]:
    """Prompt indices in chunks, shortest prompts first, each chunk's groups x group_size rows x (its longest prompt
    + per_row) tokens within `batch_tokens` (a chunk holds one group at least).

    >>> length_chunks([30, 10, 20, 10], per_row=10, group_size=1, batch_tokens=60)
    [[1, 3], [2], [0]]
    """
    chunks: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        rows = (len(chunks[-1]) + 1) * group_size if chunks else 0
        if not chunks or rows * (lengths[index] + per_row) > batch_tokens:
            chunks.append([])
        chunks[-1].append(index)
    return chunks


def in_chunks(engine: RolloutEngine, prompts: list[Prompt], group_size: int, sampling: Sampling, protocol,
              batch_tokens: int) -> Rollouts:
    """`engine.generate(prompts, group_size, ...)`, one chunk of `length_chunks` at a time, in `prompts`' order."""
    lengths = [len(protocol.prompt_ids(p)) for p in prompts]
    chunks = length_chunks(lengths, sampling.max_new_tokens, group_size, batch_tokens)
    parts = [engine.generate([prompts[i] for i in chunk], group_size, sampling, protocol) for chunk in chunks]
    if len(parts) == 1:
        return parts[0]
    order = [i for chunk in chunks for i in chunk]  # the prompt each generated group belongs to
    rows = torch.tensor([order.index(p) * group_size + g for p in range(len(prompts)) for g in range(group_size)])
    return Rollouts.concat(parts, engine.tokenizer.pad_token_id).take(rows)


def passed(rewards: Tensor, names: list[str], pass_channel: str | None) -> Tensor | None:
    """rewards [N, K] -> [N] bool: the pass channel >= PASS_VALUE (NaN fails); None without a pass channel."""
    if pass_channel is None:
        return None
    return rewards[:, names.index(pass_channel)] >= PASS_VALUE


def channel_means(rewards: Tensor, names: list[str]) -> dict[str, float | None]:
    """rewards [N, K] -> each channel's mean over the episodes it scored (None where it scored none)."""
    out = {}
    for k, name in enumerate(names):
        present = rewards[:, k][~torch.isnan(rewards[:, k])]
        out[name] = present.mean().item() if len(present) else None
    return out


def category_accuracy(prompts: list[Prompt], passes: Tensor) -> dict[str, float]:
    """passes [P] -> {meta["category"]: share of that category's prompts passing}, for prompts that carry one."""
    counts: dict[str, list[int]] = {}
    for prompt, ok in zip(prompts, passes.tolist()):
        category = prompt.meta.get("category")
        if category is not None:
            counts.setdefault(str(category), []).append(int(ok))
    return {name: sum(oks) / len(oks) for name, oks in sorted(counts.items())}


def holdout_summaries(held: HeldOut, pass_channel: str | None) -> dict[str, dict[str, Any]]:
    """{meta["holdout"]: its prompts' count, channel means greedy and sampled, accuracy (greedy; None without a pass
    channel)}, for tasks whose held-out prompts carry a holdout (bfcl_gen: `id`, `ood`); {} for others."""
    names: dict[str, list[int]] = {}
    for p, prompt in enumerate(held.prompts):
        if prompt.meta.get("holdout") is not None:
            names.setdefault(str(prompt.meta["holdout"]), []).append(p)
    out = {}
    for name, rows in names.items():
        greedy = held.greedy.rewards[rows]  # [P_h, K]
        sampled = None
        if held.sampled is not None:  # prompt p's samples are rows p*S .. p*S+S-1
            sampled = held.sampled.rewards[[p * held.samples + s for p in rows for s in range(held.samples)]]
        passes = passed(greedy, held.names, pass_channel)
        out[name] = {"prompts": len(rows), "greedy": channel_means(greedy, held.names),
                     "sampled": channel_means(sampled, held.names) if sampled is not None else None,
                     "accuracy": passes.float().mean().item() if passes is not None else None}
    return out


def summarize(held: HeldOut, pass_channel: str | None) -> dict[str, Any]:
    """What eval.json holds (the train-time metrics are `eval_metrics` of it): prompts, samples, per-channel means
    greedy and sampled, each holdout's (`holdout_summaries`), and with a pass channel the accuracy (greedy), pass@k
    (sampled) and per-category accuracy."""
    P, S = len(held.prompts), held.samples
    summary: dict[str, Any] = {
        "prompts": P, "samples": S, "pass_channel": pass_channel,
        "greedy": channel_means(held.greedy.rewards, held.names),
        "sampled": channel_means(held.sampled.rewards, held.names) if held.sampled is not None else None,
        "accuracy": None, "pass@k": {}, "categories": {}, "holdouts": holdout_summaries(held, pass_channel),
    }
    greedy_passes = passed(held.greedy.rewards, held.names, pass_channel)  # [P]
    if greedy_passes is None:
        return summary
    summary["accuracy"] = greedy_passes.float().mean().item()
    summary["categories"] = category_accuracy(held.prompts, greedy_passes)
    if held.sampled is not None:
        correct = passed(held.sampled.rewards, held.names, pass_channel).view(P, S).sum(1).tolist()  # [P]
        summary["pass@k"] = {str(k): sum(pass_at_k(S, c, k) for c in correct) / P for k in pass_ks(S)}
    return summary


def eval_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """The metrics a training run logs from `summarize`'s dict: eval/<channel>/mean (greedy), with k = `samples` > 0
    eval/<channel>/mean@k (the mean over each prompt's k sampled episodes, at the training's temperature: it moves
    before a greedy answer flips), eval/accuracy, eval/pass@k, eval/<category>/accuracy, and for each holdout its
    own eval/<holdout>/<channel>/mean, /mean@k and eval/<holdout>/accuracy."""
    metrics: dict[str, Any] = {f"eval/{name}/mean": value for name, value in summary["greedy"].items()}
    if summary["sampled"] is not None:
        metrics.update({f"eval/{name}/mean@{summary['samples']}": v for name, v in summary["sampled"].items()})
    if summary["accuracy"] is not None:
        metrics["eval/accuracy"] = summary["accuracy"]
    metrics.update({f"eval/pass@{k}": value for k, value in summary["pass@k"].items()})
    metrics.update({f"eval/{name}/accuracy": value for name, value in summary["categories"].items()})
    for holdout, part in summary.get("holdouts", {}).items():  # eval/<holdout>/<channel>/mean, .../accuracy
        metrics.update({f"eval/{holdout}/{name}/mean": value for name, value in part["greedy"].items()})
        if part["sampled"] is not None:
            metrics.update({f"eval/{holdout}/{name}/mean@{summary['samples']}": value
                            for name, value in part["sampled"].items()})
        if part["accuracy"] is not None:
            metrics[f"eval/{holdout}/accuracy"] = part["accuracy"]
    return metrics


def prompt_records(held: HeldOut, pass_channel: str | None) -> list[dict[str, Any]]:
    """eval.jsonl's lines, one per prompt: id (meta["id"], else the prompt's index), the prompt, the greedy
    transcript, each channel's value (None: abstained or failed), passed (None without a pass channel), and with
    samples how many of the prompt's sampled episodes passed (sampled_passed)."""
    greedy_passes = passed(held.greedy.rewards, held.names, pass_channel)
    sampled_passes = None
    if held.sampled is not None and pass_channel is not None:
        sampled_passes = passed(held.sampled.rewards, held.names, pass_channel).view(-1, held.samples).sum(1)
    records = []
    for p, (prompt, episode) in enumerate(zip(held.prompts, held.greedy.episodes)):
        record = {
            "id": prompt.meta.get("id", p), "prompt": prompt.text, "completion": episode.completion,
            "turns": episode.turns, "tool_calls": [asdict(call) for call in episode.tool_calls],
            "rewards": {name: None if math.isnan(v) else v
                        for name, v in zip(held.names, held.greedy.rewards[p].tolist())},
            "passed": None if greedy_passes is None else bool(greedy_passes[p]),
        }
        if "category" in prompt.meta:
            record["category"] = prompt.meta["category"]
        if sampled_passes is not None:
            record["sampled_passed"] = int(sampled_passes[p])  # of eval.json's `samples`
        records.append(record)
    return records


def outcomes_path(run_dir: Path, step: int) -> Path:
    """Where a run's held-out evaluation at `step` keeps its outcomes (`outcome_rows`).

    >>> outcomes_path(Path("run"), 30).as_posix()
    'run/held_out/step_000030.jsonl'
    """
    return run_dir / HELD_OUT_DIR / f"step_{step:06d}.jsonl"


def outcome_rows(held: HeldOut) -> list[dict[str, Any]]:
    """held_out/step_<N>.jsonl's lines: one per prompt and episode, the greedy one first (sample "greedy"), then its
    sampled ones (sample 0 .. S-1), each with the prompt's id (meta["id"], else its index), its category where it has
    one, and every channel's value (None: abstained or failed).  Two runs scored on the same prompts pair up by id:
    the unit of mrl.repro.paired's verdicts."""
    rows = []
    for p, prompt in enumerate(held.prompts):
        head = {"id": prompt.meta.get("id", p)} | ({"category": prompt.meta["category"]}
                                                   if "category" in prompt.meta else {})
        episodes = [("greedy", held.greedy.rewards[p])]
        if held.sampled is not None:
            episodes += [(s, held.sampled.rewards[p * held.samples + s]) for s in range(held.samples)]
        for sample, rewards in episodes:  # rewards [K]
            rows.append(head | {"sample": sample} | {name: None if math.isnan(v) else v
                                                      for name, v in zip(held.names, rewards.tolist())})
    return rows


@contextmanager
def separate_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Draw from generators seeded with `seed`, then put every generator (Python, NumPy, torch CPU and `device`'s)
    back as it was: a run with held-out evaluations samples the same training rollouts as one without, and each
    evaluation samples with the same seed (its points differ by the weights, not by the draw)."""
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            random.seed(seed)
            np.random.seed(seed)
            torch.manual_seed(seed)
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


def nonempty_held_out(task: Task, count: int) -> list[Prompt]:
    """`count` held-out prompts of `task` (fewer when its held-out split is smaller), refusing none at all."""
    prompts = held_out_prompts(task, count)
    if not prompts:
        raise UserError("the task has no held-out prompts (a dataset with data.eval_fraction=0 holds none out); set "
                        "data.eval_fraction > 0, or give data.path a file with enough rows")
    return prompts


def check_counts(prompts: int, samples: int) -> None:
    if prompts < 1:
        raise UserError(f"--prompts {prompts}: give at least 1 held-out prompt to score (64 by default)")
    if samples < 0:
        raise UserError(f"--samples {samples}: give 0 (greedy only) or more sampled episodes per prompt")


# ---- mrl eval ---------------------------------------------------------------------------------------------------

def evaluate(run_dir: Path, num_prompts: int = 64, samples: int = 4, seed: int = 0, out: Path | None = None,
             overrides: Sequence[str] = (), trust_config: bool = False) -> dict[str, Any]:
    """`mrl eval RUN_DIR [key=value...]`: score the run's newest intact checkpoint on `num_prompts` held-out
    prompts, one greedy and `samples` sampled episodes each, with the run's config changed by `overrides` (plain
    keys, such as data.path=other.jsonl).  Writes eval.json and eval.jsonl to `out` (default: RUN_DIR); returns
    eval.json's content."""
    check_counts(num_prompts, samples)
    cfg = with_overrides(run_config(run_dir, trust_config), overrides)
    fits.check(cfg)  # a foreign run's counts and task sizes, before anything is built
    checkpoint = intact_checkpoint(run_dir, f"mrl eval {run_dir}")  # a damaged one is skipped, with a warning
    quiet_transformers()
    device = pick_device(cfg.trainer.device)
    tokenizer = load_tokenizer(str(checkpoint / "policy"))
    policy = load_for_inference(checkpoint, cfg.model, device).eval()  # LoRA: adapters merged into the base
    header = {"run_dir": str(run_dir), "checkpoint": checkpoint.name}
    if is_adapter_dir(checkpoint / "policy"):  # the weights beside the checkpoint's that were scored
        header["base_model"] = adapter_base(checkpoint, cfg.model)
    return evaluate_policy(cfg, policy, tokenizer, device, num_prompts, samples, seed, header, out or run_dir)


def with_overrides(cfg, overrides: Sequence[str]):
    """A run's config with `key=value` overrides merged in (keys only: a group choice such as rewards=... would need
    the run's config composed again)."""
    if not overrides:
        return cfg
    groups = [o for o in overrides if "." not in o.split("=", 1)[0] or "=" not in o]
    if groups:
        raise UserError(f"{groups[0]}: a run's config takes key=value overrides (data.path=..., "
                        "rewards.pass_channel=...), not a group choice; to score with other rewards, use --model")
    try:
        return OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as err:
        raise UserError(f"overrides {' '.join(overrides)}: {str(err).splitlines()[0]}") from None


def evaluate_model(model: str, overrides: Sequence[str] = (), num_prompts: int = 64, samples: int = 4,
                   seed: int = 0, out: Path | None = None) -> dict[str, Any]:
    """`mrl eval --model DIR [overrides]`: score a model with no training, on the held-out prompts of the config
    that `conf/train.yaml` composes with `overrides` (`rewards=...`, `data.path=...`), `model.name_or_path` set to
    `model` (a model directory, or builtin:tiny).  Writes eval.json and eval.jsonl to `out` (default: a new dir
    under outputs/eval/); returns eval.json's content, with the dir it wrote under "out"."""
    check_counts(num_prompts, samples)
    if model != BUILTIN_TINY and not Path(model).expanduser().is_dir():
        raise UserError(f"--model {model}: no such directory; give a model directory (config.json, weights, "
                        f"tokenizer) or {BUILTIN_TINY}")
    cfg = compose_for_eval(overrides, model)
    validate(cfg)
    quiet_transformers()
    device = pick_device(cfg.trainer.device)
    path = resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(path)
    policy = load_causal_lm(path, cfg.model, device).eval()
    header = {"model": model, "overrides": list(overrides)}
    return evaluate_policy(cfg, policy, tokenizer, device, num_prompts, samples, seed, header,
                           out or new_eval_dir(Path("outputs") / "eval"))


def compose_for_eval(overrides: Sequence[str], model: str):
    """conf/train.yaml composed with `overrides` (Hydra's compose API, as the tests do), `model.name_or_path` set
    after composing (a path needs no override quoting).  A bad override is a one-line UserError."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    import mrl.core.config  # noqa: F401  registers the schemas

    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise UserError(f"overrides {' '.join(overrides)}: {str(err).splitlines()[0]}") from None
    cfg.model.name_or_path = model
    return cfg


def new_eval_dir(root: Path) -> Path:
    """A dir name under `root` that does not exist yet (not created: nothing is written before the evaluation)."""
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    candidate, n = root / stamp, 1
    while candidate.exists():
        candidate, n = root / f"{stamp}_{n}", n + 1
    return candidate


def evaluate_policy(cfg, policy, tokenizer, device: torch.device, num_prompts: int, samples: int, seed: int,
                    header: dict[str, Any], out: Path) -> dict[str, Any]:
    """Score `policy` on the held-out prompts of `cfg`'s task and write out/eval.json, out/eval.jsonl and
    out/outcomes.jsonl (every episode's channel values, `outcome_rows`)."""
    check_writable(out / EVAL_FILE, EVAL_AGAIN)  # a read-only mount: said before the scoring, not after it
    task = build_task(cfg)
    prompts = nonempty_held_out(task, num_prompts)
    reward_set = build_reward_set(cfg.rewards, cfg.algo)
    engine = ROLLOUT_ENGINES.choose(cfg.rollout.engine)(cfg, policy, tokenizer, device)
    try:
        with separate_rng(seed, device):
            held = score_held_out(engine, prompts, Sampling.of(cfg.trainer), samples,
                                  episode_protocol(cfg, tokenizer, task), reward_set, cfg.trainer.eval_batch_tokens)
    finally:
        engine.close()
    report = {**header, **summarize(held, cfg.rewards.pass_channel)}
    with disk_faults(out, EVAL_AGAIN):
        out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / EVAL_FILE, json.dumps(report, indent=2) + "\n", EVAL_AGAIN)
    atomic_write_jsonl(out / EVAL_LINES, prompt_records(held, report["pass_channel"]), EVAL_AGAIN)
    atomic_write_jsonl(out / EVAL_OUTCOMES, outcome_rows(held), EVAL_AGAIN)
    return {**report, "out": str(out)}


EVAL_AGAIN = "run mrl eval again (--out DIR writes its files elsewhere)"


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_table(report: dict[str, Any]) -> str:
    """The per-channel means, greedy and sampled, then accuracy, pass@k and per-category accuracy where known."""
    channels = list(report["greedy"])
    source = report.get("checkpoint") or report.get("model")
    rows = [f"Held-out prompts: {report['prompts']} ({source})", "",
            "| decoding | " + " | ".join(channels) + " |", "|---|" + "---|" * len(channels)]
    for mode in ("greedy", "sampled"):
        if report.get(mode) is not None:
            rows.append(f"| {mode} | " + " | ".join(_cell(report[mode][c]) for c in channels) + " |")
    if report.get("accuracy") is not None:
        passes = "".join(f", pass@{k} {v:.3f}" for k, v in report["pass@k"].items())
        rows += ["", f"accuracy ({report['pass_channel']} >= {PASS_VALUE:g}, greedy): {report['accuracy']:.3f}"
                 f"{passes}"]
        rows += [f"  {name}: {value:.3f}" for name, value in report["categories"].items()]
    for holdout, part in report.get("holdouts", {}).items():
        rows += ["", f"holdout {holdout} ({part['prompts']} prompts):"]
        for mode in ("greedy", "sampled"):
            if part.get(mode) is not None:
                rows.append(f"  {mode}: " + ", ".join(f"{c} {_cell(part[mode][c])}" for c in channels))
        if part.get("accuracy") is not None:
            rows.append(f"  accuracy: {part['accuracy']:.3f}")
    return "\n".join(rows)

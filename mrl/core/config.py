"""Dataclass schemas for every config group, registered in Hydra's ConfigStore.

Each YAML file in conf/<group>/ starts with `defaults: [<group>_schema, _self_]`, so a misspelt key or a value of the
wrong type fails when the config is composed, with the key named, not 200 steps into a run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, OmegaConf

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def bounded(default: Any, low: float | None = None, high: float | None = None, *, strict: bool = False,
            below_high: bool = False, fix: str = "") -> Any:
    """A schema field's default and its bound, side by side (`Bound`'s arguments): mrl.train.validation checks every
    bounded field of the schemas (`schema_bounds`) before a run starts."""
    return field(default=default, metadata={"bound": dict(low=low, high=high, strict=strict, below_high=below_high,
                                                          fix=fix)})


def schema_bounds(prefix: str, schema: type) -> list[Bound]:
    """The `Bound` of every bounded field of `schema` (a dataclass), keyed `<prefix>.<field>` (`<field>` without a
    prefix), in field order."""
    return [Bound(f"{prefix}.{f.name}" if prefix else f.name, **f.metadata["bound"])
            for f in fields(schema) if "bound" in f.metadata]


class UserError(ValueError):
    """A bad setting or input: the CLI prints the message alone (no traceback) and exits non-zero."""


@dataclass(frozen=True)
class Bound:
    """A finite number within [low, high] (an end left None is open; `strict` excludes `low`)."""

    key: str
    low: float | None = None
    high: float | None = None
    strict: bool = False  # value > low rather than >= low
    below_high: bool = False  # value < high rather than <= high
    fix: str = ""

    def rule(self) -> str:
        lo = None if self.low is None else f"{'>' if self.strict else '>='} {self.low:g}"
        hi = None if self.high is None else f"{'<' if self.below_high else '<='} {self.high:g}"
        return " ".join(["a finite number", " and ".join(part for part in (lo, hi) if part)]).strip()

    def holds(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.strict else value < self.low):
            return False
        return self.high is None or (value < self.high if self.below_high else value <= self.high)

    def check(self, value: Any, key: str | None = None) -> None:
        """Raise a UserError naming `key` (default: this bound's), `value`, the rule and the fix, unless it holds."""
        key = key or self.key
        if not self.holds(float(value)):
            fix = f"; {self.fix}" if self.fix else ""
            raise UserError(f"{key}={value}: must be {self.rule()}{fix}")


class Registry(dict):
    """The implementations of one extension point by name (an estimator, a loss aggregation, a rollout engine, a tool
    protocol): the config key that picks one, and where they are registered.  The key is a plain string in the schema
    and its choices are this dict's keys, so adding an implementation is one entry (docs/extending.md)."""

    def __init__(self, key: str, where: str, entries: dict[str, Any]):
        super().__init__(entries)
        self.key, self.where = key, where

    def choose(self, name: str, why: str = "") -> Any:
        """The entry `name`, or a UserError naming the key, the value, the choices and where they are registered."""
        if name not in self:
            raise UserError(f"{self.key}={name!r}: choose one of {', '.join(self)} (registered in {self.where}"
                            f"{'; ' + why if why else ''})")
        return self[name]


class KLMode(str, Enum):
    loss = "loss"  # k3 KL as a loss term, per token (GRPO paper, TRL's beta)
    # -kl_coef * per-token KL added to each generated token's reward (PPO-RLHF).  PPO (GAE) only: a group-relative
    # estimator would normalize the penalty away.
    reward = "reward"


class Critic(str, Enum):
    model = "model"  # a separate value model: a copy of the policy's backbone plus a scalar head
    head = "head"  # a scalar head on the policy's last hidden state, sharing its backbone


class ChannelKind(str, Enum):
    reward = "reward"
    constraint = "constraint"


class Sandbox(str, Enum):
    bwrap = "bwrap"  # bubblewrap: namespaces, read-only system view, no network (apt-get install bubblewrap)
    process = "process"  # a plain child process with rlimits and Python guards: unsafe for untrusted code


class Enforce(str, Enum):
    veto = "veto"  # a violating rollout gets every other channel's gated_value
    drop = "drop"  # a violating rollout is left out of the update
    # The violation rate (the expected cost) may reach `budget`: the channel's price, a Lagrange multiplier, is
    # learned online and is the channel's weight in the advantage (mrl/algo/advantages.py: dual_step).
    budget = "budget"


class PriceKind(str, Enum):
    integral = "integral"  # lambda <- lambda + lambda_lr * (cost - budget): projected dual ascent (dual_step)
    pid = "pid"  # a PID controller on the cost (mrl/algo/prices.py: Stooke et al., 2020)


# The pid price's gains when `price` leaves them unset, relative to the budget d (the error is e = (cost - d) / d):
# the best of a 6-set pilot on agent_triple_binding (docs/constraints.md, "A damped price").  ki 0.005 is the integral
# price's lambda_lr 0.1 at d = 0.05; kd 0: the derivative bought nothing there (delay matters only with kd > 0).
PID_DEFAULTS = {"kp": 1.0, "ki": 0.005, "kd": 0.0, "ema": 0.9, "delay": 10}


@dataclass
class PriceConfig:
    """How a budget's price moves (docs/constraints.md).  `integral`: the dual step of `lambda_lr`, the keys below
    unset.  `pid`: lambda = P + I + D, clamped to [0, lambda_max], with gains relative to the budget d (e = (cost - d)
    / d): P = kp * e on the cost's EMA (weight `ema` on the past), I += ki * e on each step's mean cost, D = kd *
    (the EMA's rise over `delay` steps, never below 0) / d; an unset key takes PID_DEFAULTS."""

    kind: PriceKind = PriceKind.integral
    kp: Optional[float] = None
    ki: Optional[float] = None
    kd: Optional[float] = None
    ema: Optional[float] = None
    delay: Optional[int] = None


@dataclass
class AlgoConfig:
    """One trainer: an estimator of the registry in mrl/algo/advantages.py plus switches that combine with any of
    them."""

    name: str = MISSING
    advantage: str = "grpo"  # an estimator of mrl.algo.advantages.ESTIMATORS
    # Per-channel weights overriding rewards.channels.<name>.weight; keys must be the channel names.
    # null: the channels' own weights.  (Typed Any: OmegaConf cannot merge a dict into a None Dict[str, float].)
    weights: Any = None
    gdpo_batch_norm: bool = True
    # GD²PO-SNR (advantage=gd2po_snr): a rollout whose channels conflict is dropped where |rho| < gd2po_tau, rho =
    # sum z / sum |z| (0.8 in every script of theirs; their code's default 0.2).
    gd2po_tau: float = bounded(0.8, 0, 1, fix="the share of a rollout's channel signal that must agree in sign for it "
                                             "to stay (0: drop none, 1: drop every conflict); their scripts use 0.8")
    adv_eps: float = bounded(1e-6, 0, strict=True, fix="it keeps the advantage's std away from 0 (1e-6 by default)")
    epochs: int = bounded(1, 1, fix="passes over each batch")  # PPO epochs / GRPO mu
    clip_low: float = bounded(0.2, 0, 1, below_high=True,
                              fix="the ratio is clipped to [1 - clip_low, 1 + clip_high]; PPO uses 0.2")
    # > clip_low is DAPO's clip-higher
    clip_high: float = bounded(0.2, 0, fix="the ratio is clipped to [1 - clip_low, 1 + clip_high]; DAPO's "
                                           "clip-higher uses 0.28")
    loss_agg: str = "seq_mean"  # an aggregation of mrl.algo.losses.AGGREGATIONS
    kl_coef: float = bounded(0.0, 0, fix="0 turns the KL term off (no reference model is loaded)")
    kl_mode: KLMode = KLMode.loss
    entropy_coef: float = bounded(0.0)
    # DAPO dynamic sampling: drop dead groups, draw more prompts until the batch is full or the cap is hit.
    dynamic_sampling: bool = False
    max_gen_batches: int = bounded(4, 1, fix="generation rounds per step with dynamic sampling")
    # DAPO overlong shaping: a penalty rising linearly over the last `overlong_buffer` tokens before
    # max_new_tokens, logged as its own channel `overlong` (in [-1, 0]) whose weight is `overlong_penalty`.
    # 0 turns it off.
    overlong_buffer: int = bounded(0, 0, fix="0 turns overlong shaping off")
    overlong_penalty: float = bounded(1.0, 0, fix="the overlong channel's weight")
    # PPO: critic, GAE, value loss.
    critic: Optional[Critic] = None
    # The value model's, or the value head's, learning rate; by default the model preset's (a pretrained backbone
    # wants ~1e-5, the built-in tiny model its tuned 1e-3).
    critic_lr: float = II("model.critic_lr")
    gamma: float = bounded(1.0, 0, 1)
    lam: float = bounded(0.95, 0, 1)
    value_clip: float = bounded(0.2, 0)
    # weight of the value loss when the critic is a head sharing the policy's optimizer
    vf_coef: float = bounded(0.5, 0)
    whiten_advantages: bool = True  # PPO: normalize GAE advantages over the batch's generated tokens
    # Channels a preset shapes by name in rewards.channels (gdpo_conditioned: efficiency, safety).  The shaping
    # applies where the rewards have the channel; where they do not, the entry the preset wrote (it has no `fn`) is
    # left out, so the preset composes with every `rewards=` option (mrl.rewards.channels.configured_channels).
    shapes: list[str] = field(default_factory=list)


@dataclass
class ChannelConfig:
    """A reward channel: a callable built from `fn` (a `_target_` node) plus how it enters the advantage."""

    fn: Any = MISSING
    weight: float = bounded(1.0)
    # A constraint with `enforce` set is enforced (veto or drop) instead of weighted; a value below
    # `violation_below` is a violation.
    kind: ChannelKind = ChannelKind.reward
    enforce: Optional[Enforce] = None
    violation_below: float = bounded(0.0)
    # enforce: budget (docs/constraints.md).  The channel's cost is minus its value (safety's -1 per violation is an
    # indicator cost: its mean is the violation rate); `budget` is the allowed expected cost per episode.  Each step
    # lambda <- min(lambda_max, max(0, lambda + lambda_lr * (mean cost - budget))), and lambda replaces `weight`.
    # lambda_init 0: a budget that is met costs nothing.  lambda_lr 0.1: with an indicator cost 50 points over budget
    # the price reaches a reward channel's weight (1) in ~20 steps, a few percent of a run, and falls back slowly
    # (lambda_lr * budget a step) once the budget is met.  lambda_max 10: ten times a reward channel's weight, where
    # the cost already decides every group's ranking; the cap keeps a budget no policy can meet from growing without
    # end (a bound the dual ascent needs).
    budget: Optional[float] = None
    lambda_lr: float = 0.1
    lambda_init: float = 0.0
    lambda_max: float = 10.0
    price: PriceConfig = field(default_factory=PriceConfig)  # integral (the update above) or pid
    # Conditioned reward (GDPO Eq. 8): pay this channel only where channel `condition_on` >= `threshold`, and
    # `gated_value` elsewhere (also what a vetoed rollout gets on this channel).
    condition_on: Optional[str] = None
    threshold: float = bounded(1.0)
    gated_value: float = bounded(0.0)


@dataclass
class RewardsConfig:
    name: str = MISSING
    task: Any = MISSING  # `_target_` node building the task: prompts and episode metadata
    channels: dict[str, ChannelConfig] = field(default_factory=dict)
    # A channel that raises or returns a non-number: `raise` stops the run (after writing a checkpoint of the last
    # completed step); `drop` leaves the sample out of the update and counts it (rewards/failed_frac).
    on_error: str = "raise"
    # Where generated code runs (the code channels): see mrl/sandbox/ and docs/sandbox.md (the threat model).
    sandbox: Sandbox = Sandbox.bwrap
    # With `drop`: a channel that fails on every sample for this many steps in a row stops the run (0: never).
    max_failed_steps: int = 3
    # The channel that says whether an episode solved the task: it passes when this channel's value is >= 1.0
    # (BFCL's `correctness`, HumanEval's `pass_rate`).  Held-out evaluation reports accuracy and pass@k from it;
    # null: the task has no pass/fail notion, and evaluation reports the channels' means only.
    pass_channel: Optional[str] = None


@dataclass
class TinyModelSpec:
    """Architecture of the built-in random-init model (Llama layout)."""

    vocab_size: int = 32
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 64
    init_seed: int = 0


@dataclass
class LoraSettings:
    """LoRA through peft (mrl/modeling/lora.py): the policy trains rank-`r` adapters on frozen base weights."""

    r: int = bounded(0, 0, fix="the adapters' rank; 0 turns LoRA off, 16 is usual")  # 0: off (full fine-tuning)
    alpha: float = bounded(32.0, 0, strict=True, fix="the adapters' output is scaled by alpha / r; 2 * r is usual")
    dropout: float = bounded(0.0, 0, 1, below_high=True, fix="dropout on the adapters' input; 0 turns it off")
    # Which modules get adapters: peft's "all-linear" (every linear layer of attention and MLP; the LM head and
    # embeddings excluded), or a list of module names such as [q_proj, v_proj].
    target_modules: Any = "all-linear"


@dataclass
class ModelConfig:
    # A hub id (`Qwen/Qwen3-0.6B`), a local model directory, or `builtin:tiny` for the built-in model.
    name_or_path: str = MISSING
    # float32 | bfloat16 | float16: the dtype checkpoints export (and on a GPU, with compute_dtype auto, the dtype it
    # computes in); trained weights and optimizer states are float32 whatever it says (mrl/modeling/precision.py).
    dtype: str = "float32"
    # auto | float32 | bfloat16 | float16: the dtype forwards and backwards compute in, under autocast.  auto: bfloat16
    # on a CPU with native bf16 matmuls (AMX, AVX-512 BF16; float32 on one without, where bf16 is slow), model.dtype on
    # a GPU.
    compute_dtype: str = "auto"
    use_chat_template: bool = False  # wrap task prompts with the tokenizer's chat template
    # How agents call tools (mrl/chat/protocols.py): `chat` in the model's own chat format
    # (`<tool_call>{json}</tool_call>`, results as `tool` messages), `words` the built-in tiny model's (a tool's name as
    # a word), `auto` chat when use_chat_template and the tokenizer has a template.
    tool_format: str = "auto"  # a protocol of mrl.chat.protocols.PROTOCOLS
    # Extra variables for the chat template, e.g. {enable_thinking: false} for Qwen3 (thinking mode otherwise).
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    gradient_checkpointing: bool = False
    critic_lr: float = 1e-5  # algo.critic_lr's default: a rate suited to fine-tuning this backbone as a critic
    attn_implementation: Optional[str] = None
    tiny: Optional[TinyModelSpec] = None
    lora: LoraSettings = field(default_factory=LoraSettings)


@dataclass
class DeepSpeedConfig:
    enabled: bool = False
    stage: int = bounded(0, 0, 3, fix="the ZeRO stage; pick a preset: deepspeed=none|zero1|zero2|zero3")
    # Read from model.dtype and model.compute_dtype, not set here: a bfloat16 (float16) compute dtype turns on
    # DeepSpeed's bf16 (fp16) mode, which keeps float32 masters and optimizer states in the ZeRO optimizer
    # (mrl/modeling/precision.py).
    model_dtype: str = "${model.dtype}"
    compute_dtype: str = "${model.compute_dtype}"
    gradient_clipping: float = bounded(1.0, 0)
    offload_optimizer: bool = False
    offload_param: bool = False


@dataclass
class LoggerConfig:
    backend: str = "none"  # wandb | none (metrics.jsonl is always written)
    project: str = "mrl"
    entity: Optional[str] = None
    mode: str = "offline"  # offline | online | disabled
    name: Optional[str] = None  # null: <algo>/seed<n>, or a sweep job's dir name (mrl.runs.tracking.run_labels)
    group: Optional[str] = None  # null: the sweep dir in a sweep (-m), none otherwise
    trl_names: bool = False  # W&B keys reward/<ch>/... as TRL's rewards/<ch>/... (metrics.jsonl keeps reward/)
    tags: list[str] = field(default_factory=list)
    log_every: int = bounded(10, 1)  # plain-line progress every N steps when stdout is not a terminal
    # every N steps, a few transcripts to samples.jsonl (and a W&B table); 0: never
    samples_every: int = bounded(25, 0, fix="0 writes no transcripts")


@dataclass
class TrainerConfig:
    max_steps: int = bounded(300, 1, fix="a positive number of steps")
    seed: int = bounded(0, 0, 2**32 - 1, fix="NumPy takes 32-bit unsigned seeds")
    prompts_per_step: int = bounded(8, 1)
    group_size: int = bounded(8, 1)
    max_new_tokens: int = bounded(10, 1)
    # most tokens one tool result adds (its chat-template wrapping included); cut beyond
    max_tool_tokens: int = bounded(256, 1, fix="the most tokens one tool result adds (256 by default)")
    # Sampling: exactly these, whatever the model's generation_config.json says (repetition_penalty etc. never apply).
    temperature: float = bounded(1.0, 0, strict=True, fix="rollouts are sampled from softmax(logits / temperature); "
                                                          "1.0 samples the model's own distribution")
    top_p: float = bounded(1.0, 0, 1, strict=True, fix="1.0 turns nucleus sampling off")
    top_k: int = bounded(0, 0, fix="0 turns top-k sampling off")
    lr: float = bounded(3e-4, 0, strict=True, fix="AdamW's learning rate: 3e-4 suits the built-in tiny model, about "
                                                  "1e-6 a pretrained one")
    weight_decay: float = bounded(0.0, 0, fix="0 turns it off")
    grad_clip: float = bounded(1.0, 0, strict=True, fix="the gradient norm is clipped to it (1.0 by default)")
    micro_batch_size: int = bounded(32, 1)
    num_mini_batches: int = bounded(1, 1, fix="optimizer steps per epoch over the batch")
    save_every: int = bounded(50, 1, fix="a checkpoint every N steps (and at the end)")
    # false; true = the latest checkpoint in this run dir; or a path to a checkpoint or a run dir.
    resume: Any = False
    device: str = "auto"  # auto = cuda if present, else cpu
    # Held-out evaluation during training (mrl/train/evaluate.py): every `eval_every` steps, at step 0 (the base model)
    # and at the last step, `eval_prompts` held-out prompts are scored greedy (eval/<channel>/mean, eval/accuracy) and,
    # with `eval_samples` > 0, sampled that many times each (eval/pass@k for k = 1, 2, 4, ... <= eval_samples).
    # eval_every 0: off.
    eval_every: int = bounded(0, 0, fix="a held-out evaluation every N steps (and at step 0 and the end); 0 turns "
                                        "it off")
    eval_prompts: int = bounded(32, 1, fix="held-out prompts scored at each evaluation (32 by default)")
    eval_samples: int = bounded(0, 0, fix="sampled episodes per held-out prompt, for pass@k; 0 scores greedy only")
    # false: skip step 0's evaluation, where it repeats one already made (runs from one warm start, greedy: the warm
    # start's own evaluation is every run's step 0; the reproductions draw it from there).
    eval_at_start: bool = True
    # The held-out evaluation generates in chunks of at most this many rows x (prompt + max_new_tokens) tokens,
    # prompts of like length together (mrl.train.evaluate.in_chunks): its KV cache stays within about this many tokens'
    # worth (SmolLM2-135M: 46 KB a token, 0.75 GB at 16384) whatever trainer.eval_prompts is.
    eval_batch_tokens: int = bounded(16384, 1, fix="rows x (prompt + max_new_tokens) tokens a held-out generate call "
                                                   "may hold (16384 by default): it bounds the evaluation's KV cache")
    # A warm start: an `mrl sft` (or `mrl train`) run dir, or one of its checkpoints; its newest intact checkpoint's
    # policy is this run's starting point and KL reference (LoRA adapters merged into the base), its lineage
    # recorded in lineage.json (mrl/runs/warm_start.py).  null: model.name_or_path.
    init_from: Optional[str] = None


@dataclass
class SftConfig:
    """`mrl sft`: supervised fine-tuning on a task's demonstrations (mrl/train/sft.py)."""

    lr: float = bounded(2e-5, 0, strict=True, fix="AdamW's learning rate for SFT: 2e-5 suits SmolLM2-135M")
    # passes over the demonstrations (fractions allowed), unless `steps` is set
    epochs: float = bounded(1.0, 0, strict=True, fix="passes over the demonstrations (1.0: one)")
    # optimizer steps (0: from `epochs`)
    steps: int = bounded(0, 0, fix="optimizer steps; 0 takes them from sft.epochs")
    # demonstrations per optimizer step (over all ranks)
    batch_size: int = bounded(4, 1, fix="demonstrations per optimizer step")
    # demonstrations per forward/backward (gradient accumulation up to batch_size)
    micro_batch_size: int = bounded(4, 1, fix="demonstrations per forward and backward")
    # the learning rate rises linearly from 0 over these steps, then stays at `lr`
    warmup_steps: int = bounded(0, 0, fix="0 starts at sft.lr")
    # a longer demonstration is cut to it, with one warning naming the records cut
    max_seq_len: int = bounded(1024, 8, fix="the most tokens of one demonstration, prompt included (1024 by default)")
    # demonstrations drawn from a generator task (agent_triple, tool_call, calc_agent)
    max_records: int = bounded(512, 1, fix="demonstrations drawn from a generator task")
    # a held-out evaluation every N steps (and at step 0 and the end; 0: only those two)
    eval_every: int = bounded(0, 0, fix="a held-out evaluation every N SFT steps; 0: at the start and the end only")
    # a checkpoint every N steps, and after the last
    save_every: int = bounded(1000, 1, fix="a checkpoint every N SFT steps (and after the last)")


@dataclass
class VllmSettings:
    """The vLLM engine's (`rollout.engine=vllm`, mrl/generation/vllm_engine.py): colocated in the trainer's process."""

    max_model_len: int = bounded(4096, 1, fix="the longest prompt + transcript one episode may reach, in tokens")
    # CPU: the KV cache's memory (vLLM's kv_cache_memory_bytes); SmolLM2 in float32 holds ~23k tokens a GiB
    kv_cache_gb: float = bounded(2.0, 0, strict=True, fix="the KV cache's size in GiB on a CPU (2 by default)")
    # CUDA: the share of the GPU's memory vLLM takes (weights and KV cache), beside the trainer's
    gpu_memory_utilization: float = bounded(0.3, 0, 1, strict=True, fix="the share of the GPU vLLM takes; 0.3-0.5")
    sleep: bool = True  # CUDA: release vLLM's memory between generation and update (sleep mode); a CPU has none


@dataclass
class RolloutConfig:
    """How rollouts are generated: an engine of mrl.generation.rollout.ROLLOUT_ENGINES."""

    # mrl's turn loop on the training module itself, each turn decoded by: native = mrl's own decoder (Llama, Qwen2,
    # Qwen3, Mistral), captured = the native decoder under captured CUDA graphs, hf = HF generate; or vllm = vLLM
    # (`pip install 'mrl[vllm]'`) in this process, its weights synced after every update.  auto = vllm where it is
    # installed and runs the model, else captured on CUDA where it passes its first-use check, native elsewhere where
    # it runs the model, else hf.
    engine: str = "auto"
    # Where another engine (vLLM) samples, each token's loss is weighed by exp(trainer's old log-prob - sampler's),
    # as mrl.algo.losses.SAMPLER_WEIGHTS names: token_truncate (min(r, cap)), token_mask, sequence_truncate,
    # sequence_mask (TRL's modes), or none.
    importance_weight: str = "token_truncate"
    importance_cap: float = bounded(2.0, 1, fix="the importance weight's cap C (TRL's and verl's 2-3)")
    vllm: VllmSettings = field(default_factory=VllmSettings)


@dataclass
class DataConfig:
    """Prompts from a local dataset instead of the task's built-in generator (see mrl/core/data.py for the schema)."""

    path: Optional[str] = None  # a .jsonl or .parquet file, or a `datasets` save_to_disk dir (`dir::split`)
    # held out, by trainer.seed, for `mrl eval`
    eval_fraction: float = bounded(0.1, 0, 1, below_high=True, fix="0 holds nothing out; 0.1 holds out 10%")
    text_field: str = "prompt"


@dataclass
class TrainConfig:
    stage: str = "rl"  # rl: `mrl train` (conf/train.yaml); sft: `mrl sft` (conf/sft.yaml)
    algo: AlgoConfig = MISSING
    rewards: RewardsConfig = MISSING
    model: ModelConfig = MISSING
    deepspeed: DeepSpeedConfig = MISSING
    logger: LoggerConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SftConfig = field(default_factory=SftConfig)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for group, schema in [
        ("algo", AlgoConfig),
        ("rewards", RewardsConfig),
        ("model", ModelConfig),
        ("deepspeed", DeepSpeedConfig),
        ("logger", LoggerConfig),
    ]:
        cs.store(group=group, name=f"{group}_schema", node=schema)


def worst_token_cost(max_new_tokens: int, max_turns: int, max_tool_tokens: int, max_call_tokens: int) -> float:
    """`${mrl.worst_token_cost:...}` in a rewards preset: minus the most tokens an episode can be charged within the
    run's budget, the gate of a token-cost channel (no real episode pays less).  Generated: at most max_new_tokens;
    observed: at most one tool result per turn, each charged at most min(max_tool_tokens, max_call_tokens), and
    a call takes at least one generated token.

    >>> worst_token_cost(10, 3, 256, 5)  # agent_triple's defaults: 10 generated + 3 calls x 5 observed
    -25.0
    """
    return -float(max_new_tokens + min(max_turns, max_new_tokens) * min(max_tool_tokens, max_call_tokens))


register_configs()
OmegaConf.register_new_resolver("mrl.worst_token_cost", worst_token_cost, replace=True)

"""Build the reward channels from config, score episodes per channel, and hand them to the shaping maths
(mrl/algo/shaping.py: conditions and constraints) with the channels' settings.

Rewards stay per channel, a [B, G, K] tensor, until the advantage step: GDPO, conditioned rewards, dead-group
detection and per-channel logging all need the channels apart.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from itertools import islice
from typing import Any, Callable

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import Tensor

from mrl.algo.advantages import Estimator, dual_step, live_groups, mean_cost
from mrl.algo.prices import PidGains, PidState, absolute_gains, pid_step
from mrl.algo.shaping import condition, drop, veto, violations
from mrl.core.config import PID_DEFAULTS, Bound, ChannelConfig, PriceKind, UserError, schema_bounds
from mrl.core.episode import Episode
from mrl.rewards.targets import check_not_trl, check_targets

log = logging.getLogger(__name__)

Channel = Callable[[Episode], float]


class RewardError(RuntimeError):
    """A reward channel raised or returned something that is not a finite number."""


class _Stop(RewardError):
    """A channel's code raised what would stop the trainer (SystemExit, KeyboardInterrupt): always raised, never
    dropped as one sample's failure."""


class OverlongPenalty:
    """DAPO's soft overlong punishment, on length alone: 0 up to `max_new_tokens - buffer` generated tokens, then
    falling linearly to -1 at `max_new_tokens`.  An episode that ends on the turn limit is not overlong.

    The coefficient (`algo.overlong_penalty`) is the channel's weight, not a factor inside it: under GDPO a factor
    inside a channel cancels in the channel's normalization, a weight does not.
    With max_new_tokens=8, buffer=4: 4 tokens -> 0.0, 6 tokens -> -0.5, 8 tokens -> -1.0.
    """

    def __init__(self, buffer: int):
        self.buffer = buffer

    def __call__(self, episode: Episode) -> float:
        over = episode.num_tokens - (episode.max_new_tokens - self.buffer)
        return -min(max(over, 0), self.buffer) / self.buffer


@dataclass
class ChannelSpec:
    name: str
    fn: Channel
    weight: float
    enforce: str | None = None  # veto | drop | budget, for constraints
    kind: str = "reward"  # reward | constraint: a constraint's violations are counted, enforced or not
    violation_below: float = 0.0
    condition_on: str | None = None
    threshold: float = 1.0
    # What the channel pays when its gate is closed: its condition fails (GDPO Eq. 8), or a veto hits the rollout.
    # A fixed value, never a batch statistic; 0 is the paper's.  A cost channel (negative values) sets one at
    # least as bad as any real episode's cost, or a gated rollout would look cheap.
    gated_value: float = 0.0
    # Added by the algorithm (overlong), not by the task: logged and weighted like the others, but a group is not
    # live just because its rollouts differ in length shaping (DAPO filters on task outcomes).
    shaping: bool = False
    # enforce=budget: the allowed expected cost (minus the value) per episode, and the dual step on its price
    budget: float = 0.0
    lambda_lr: float = 0.1
    lambda_init: float = 0.0
    lambda_max: float = 10.0
    pid: PidGains | None = None  # price.kind=pid: the controller's gains per unit of cost; None: the integral price


class RewardSet:
    """The channels of one run, in a fixed order: user channels, then the ones the algorithm adds."""

    def __init__(self, specs: list[ChannelSpec]):
        self.specs = specs
        self.names = [s.name for s in specs]
        self.task_channels = [k for k, s in enumerate(specs) if not s.shaping]  # the channels dead groups are tested on
        for spec in specs:
            if spec.condition_on is not None and spec.condition_on not in self.names:
                raise UserError(
                    f"rewards.channels.{spec.name}.condition_on={spec.condition_on!r} is not a channel; "
                    f"choose one of {self.names}"
                )
        # The price (Lagrange multiplier) of each constraint with a budget: run state, checkpointed in state.json.
        self.prices = {s.name: s.lambda_init for s in specs if s.enforce == "budget"}
        # A pid price's memory (mrl.algo.prices.PidState), run state too: checkpointed beside the prices.
        self.controllers = {s.name: PidState(integral=s.lambda_init) for s in specs
                            if s.enforce == "budget" and s.pid is not None}

    @property
    def weights(self) -> Tensor:
        """[K] weights entering the advantage: a constraint with a budget is weighted by its price (its value is minus
        its cost, so it adds -price * cost); a vetoed or dropped one is enforced instead of weighted (0)."""
        return torch.tensor([self.prices[s.name] if s.enforce == "budget" else 0.0 if s.enforce else s.weight
                             for s in self.specs])

    def update_prices(self, rewards: Tensor) -> dict[str, float]:
        """Every budgeted constraint's next price from `rewards` [M, K]: every rollout generated this step on every
        rank (gathered, so every rank computes the same prices); the dual step (mrl.algo.advantages.dual_step), or for
        price.kind=pid the controller (mrl.algo.prices.pid_step).  Returns the step's constraint/<ch>/{lambda, cost,
        budget, price_p, price_i, price_d}: the price this step's advantages paid, the mean cost, and the price's
        terms (an integral price is all I)."""
        if not self.prices:
            return {}
        ks = [self.names.index(name) for name in self.prices]
        specs = [self.specs[k] for k in ks]
        column = lambda field: torch.tensor([getattr(s, field) for s in specs], dtype=torch.float64)  # noqa: E731
        paid = torch.tensor(list(self.prices.values()), dtype=torch.float64)  # [C]
        cost = mean_cost(rewards[:, ks].to(torch.float64))  # [C]
        new = dual_step(paid, cost, column("budget"), column("lambda_lr"), column("lambda_max")).tolist()
        metrics = {}
        for c, spec in enumerate(specs):
            state = self.controllers.get(spec.name)
            terms = (state.p, state.integral, state.d) if state is not None else (0.0, paid[c].item(), 0.0)
            if state is not None:
                new[c], self.controllers[spec.name] = pid_step(state, cost[c].item(), spec.budget, spec.pid)
            metrics[f"constraint/{spec.name}/lambda"] = paid[c].item()
            metrics[f"constraint/{spec.name}/cost"] = None if cost[c].isnan() else cost[c].item()
            metrics[f"constraint/{spec.name}/budget"] = spec.budget
            metrics |= {f"constraint/{spec.name}/price_{t}": v for t, v in zip("pid", terms)}
        self.prices = dict(zip(self.prices, new))
        return metrics

    def load_prices(self, saved: dict[str, float] | None, controllers: dict[str, dict] | None = None) -> None:
        """The prices and pid controllers' states a checkpoint's state.json recorded (exactly: JSON floats
        round-trip); a constraint it has no price for (a checkpoint from before its budget) starts at its lambda_init,
        a pid price it has no state for at its saved price, all of it in the integral term."""
        self.prices.update({name: float(v) for name, v in (saved or {}).items() if name in self.prices})
        controllers = controllers or {}
        for name in self.controllers:
            self.controllers[name] = (PidState.from_json(controllers[name]) if name in controllers
                                      else PidState(integral=self.prices[name]))

    def controller_states(self) -> dict[str, dict]:
        """The pid prices' memory as plain JSON data, for state.json ({} where every price is integral)."""
        return {name: state.to_json() for name, state in self.controllers.items()}

    def live(self, shaped: Tensor, estimator: Estimator) -> Tensor:
        """shaped: [B, G, K] -> BoolTensor [B]: groups whose task channels give `estimator` (mrl.algo.advantages) a
        non-zero advantage, at the weights the advantage uses (mrl.algo.advantages.live_groups).  The algorithm's
        shaping channels (overlong) are left out: a group is not live because its rollouts differ in length shaping
        alone."""
        task = self.task_channels
        return live_groups(shaped[..., task], self.weights[task].to(shaped.dtype), estimator.group_signal)

    def score(self, episodes: list[Episode], on_error: str = "raise") -> tuple[Tensor, Tensor]:
        """Score N episodes on every channel: (rewards [N, K], failed [N, K] bool).

        A channel returning None abstains: NaN there, left out of that channel's statistics.  A channel with
        `batched = True` is called once with the list of episodes and returns one value per episode.  A channel that
        raises, or returns NaN/inf or a non-number, is an error naming the channel and the sample: raised
        (`on_error="raise"`), or with `on_error="drop"` the sample gets NaN on every channel and `failed[n, k] = True`
        for the channel k that failed (`failed.any(-1)`: the samples dropped).
        """
        rewards = torch.zeros(len(episodes), len(self.specs))
        failed = torch.zeros(len(episodes), len(self.specs), dtype=torch.bool)
        for k, spec in enumerate(self.specs):
            for n, value, problem in _evaluate(spec, episodes):
                if problem is not None:
                    if on_error != "drop":
                        raise RewardError(_describe(spec.name, n, episodes[n], problem.message)) from problem.error
                    failed[n, k] = True
                rewards[n, k] = float("nan") if value is None else value  # None: abstained, or failed
        rewards[failed.any(-1)] = float("nan")
        return rewards, failed

    def shape(self, rewards: Tensor) -> tuple[Tensor, Tensor, dict[str, float]]:
        """The channels' conditions (GDPO Eq. 8) and enforced constraints (veto, drop), rollout by rollout: the
        maths is mrl.algo.shaping's; this hands it the channels' settings and names the statistics.

        rewards: [B, G, K] -> (shaped rewards [B, G, K], keep [B, G] bool: rollouts that enter the update, stats:
        condition/<ch>/gated_frac, constraint/<ch>/{violation,veto,drop}_frac).
        """
        column = lambda values, dtype=rewards.dtype: torch.tensor(values, dtype=dtype)  # noqa: E731
        specs = self.specs
        on = column([self.names.index(s.condition_on) if s.condition_on is not None else -1 for s in specs], torch.long)
        gated = column([s.gated_value for s in specs])  # [K]
        shaped, passed = condition(rewards, on, column([s.threshold for s in specs]), gated)
        violated = violations(rewards, column([s.violation_below for s in specs]))  # [B, G, K]
        shaped = veto(shaped, violated, column([s.enforce == "veto" for s in specs], torch.bool), gated)
        keep = drop(violated, column([s.enforce == "drop" for s in specs], torch.bool))
        stats = {f"condition/{s.name}/gated_frac": (~passed[..., k]).float().mean().item()
                 for k, s in enumerate(specs) if s.condition_on is not None}
        for k, spec in enumerate(specs):
            if spec.kind == "constraint" or spec.enforce is not None:
                stats[f"constraint/{spec.name}/violation_frac"] = violated[..., k].float().mean().item()
            if spec.enforce in ("veto", "drop"):
                stats[f"constraint/{spec.name}/{spec.enforce}_frac"] = violated[..., k].float().mean().item()
        return shaped, keep, stats


class FailureStreaks:
    """With rewards.on_error=drop, the steps in a row on which each channel failed on every sample: at `limit` the run
    stops (RewardError) instead of training on nothing.  limit 0: never."""

    def __init__(self, names: list[str], limit: int):
        self.names, self.limit = names, limit
        self.counts = [0] * len(names)

    def update(self, failed: Tensor) -> None:
        """failed: [N, K] bool, every sample scored this step on every rank (gathered), so that all ranks stop at the
        same step: the error is `agreed`, and the loop checkpoints the last completed step on every rank."""
        for k, every in enumerate(failed.all(0).tolist() if len(failed) else [False] * len(self.names)):
            self.counts[k] = self.counts[k] + 1 if every else 0
            if self.limit > 0 and self.counts[k] >= self.limit:
                error = RewardError(
                    f"reward channel {self.names[k]!r} failed on every sample for {self.counts[k]} steps in a row, so "
                    "rewards.on_error=drop left nothing to train on; run with rewards.on_error=raise to see its "
                    f"error, or raise rewards.max_failed_steps (now {self.limit}; 0: never stop)"
                )
                error.agreed = True
                raise error


def _evaluate(spec: ChannelSpec, episodes: list[Episode]):
    """Yield (index, value or None to abstain, problem or None) for each episode.  A batched channel's answer is read
    one value past the batch at most (an endless generator is an error, not a list that grows until the OOM killer
    comes); a SystemExit, KeyboardInterrupt or other BaseException from a channel's code is a RewardError whatever
    rewards.on_error says (`exit()` in a reward function would end the trainer with code 0 and no checkpoint)."""
    if getattr(spec.fn, "batched", False):
        try:
            values = _user_call(spec.name, lambda: list(islice(spec.fn(episodes), len(episodes) + 1)))
        except _Stop:
            raise
        except Exception as err:  # a user's channel: the whole batch failed
            values = [_Raised(f"raised {type(err).__name__}: {err}", err)] * len(episodes)
        if len(values) != len(episodes):
            many = f"more than {len(episodes)}" if len(values) > len(episodes) else str(len(values))
            values = [_Raised(f"returned {many} values for {len(episodes)} episodes")] * len(episodes)
    else:
        values = []
        for episode in episodes:
            try:
                values.append(_user_call(spec.name, lambda: spec.fn(episode)))
            except _Stop:
                raise
            except Exception as err:  # a user's channel: report which one, on which sample
                values.append(_Raised(f"raised {type(err).__name__}: {err}", err))
    for n, value in enumerate(values):
        if isinstance(value, _Raised):
            yield n, None, value
        elif value is None:
            yield n, None, None
        elif (number := _finite(value)) is None:
            yield n, None, _Raised(f"returned {_short(value)}, not a finite number (None abstains)")
        else:
            yield n, number, None


def _user_call(channel: str, call: Callable[[], Any]) -> Any:
    """call(), a channel's code, with a BaseException that is not an Exception (SystemExit, KeyboardInterrupt,
    GeneratorExit, a class of the user's own) turned into a RewardError naming the channel.  A signal's stop
    (mrl.runs.rundir.Interrupted, which carries its `signum`) passes: the loop checkpoints on it."""
    try:
        return call()
    except Exception:
        raise
    except BaseException as err:
        if getattr(err, "signum", None) is not None:
            raise
        raise _Stop(f"reward channel {channel!r} raised {_short(err)}, which would "
                          "stop the trainer: raise an Exception instead, or return None to abstain") from None


def _finite(value: Any) -> float | None:
    """`value` as a finite float, or None where it is not one (a bool, a string, NaN, inf, an int beyond a float's
    range such as 10**400).

    >>> _finite(3), _finite(10**400), _finite(True), _finite(float("nan"))
    (3.0, None, None, None)
    """
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _short(value: Any) -> str:
    """repr(value) cut to 80 characters; a long int by its digits (its repr refuses beyond 4,300 of them).

    >>> _short(10**400), _short(SystemExit(0))
    ('an int of 401 digits', 'SystemExit(0)')
    """
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**77:
        digits = len(str(abs(value))) if value.bit_length() < 14_000 else f"about {int(value.bit_length() * 0.30103)}"
        return f"an int of {digits} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class _Raised:
    """What went wrong with one channel on one sample."""

    message: str
    error: Exception | None = None


def _describe(channel: str, index: int, episode: Episode, what: str) -> str:
    return (
        f"reward channel {channel!r} {what} on sample {index} "
        f"(prompt {episode.prompt.text!r}, completion {episode.completion!r})"
    )


def build_reward_set(rewards_cfg: Any, algo_cfg: Any) -> RewardSet:
    """Instantiate the configured channels (checked: `configured_channels`), apply algo.weights
    overrides, add the algorithm's own channels."""
    channels, left_out = configured_channels(rewards_cfg, algo_cfg)
    if left_out:
        log.info(f"algo={algo_cfg.name} shapes {', '.join(left_out)}, which rewards={rewards_cfg.name} does not have: "
                 "that part of the preset does not apply")
    overrides = dict(algo_cfg.weights) if algo_cfg.weights is not None else None
    specs = []
    for name, ch in channels.items():
        specs.append(
            ChannelSpec(
                name=name,
                fn=instantiate(ch.fn),
                weight=float(overrides[name] if overrides is not None else ch.weight),
                enforce=ch.enforce.value if ch.enforce is not None else None,
                kind=ch.kind.value,
                violation_below=ch.violation_below,
                condition_on=ch.condition_on,
                threshold=ch.threshold,
                gated_value=ch.gated_value,
                budget=ch.budget if ch.budget is not None else 0.0,
                lambda_lr=ch.lambda_lr,
                lambda_init=ch.lambda_init,
                lambda_max=ch.lambda_max,
                pid=pid_gains(ch),
            )
        )
    if algo_cfg.overlong_buffer > 0:
        specs.append(ChannelSpec("overlong", OverlongPenalty(algo_cfg.overlong_buffer), algo_cfg.overlong_penalty,
                                 shaping=True))
    return RewardSet(specs)


CHANNEL_BOUNDS = schema_bounds("", ChannelConfig)  # weight, violation_below, threshold, gated_value: finite


def check(cfg) -> None:
    """Every `_target_` of the preset imports (mrl.rewards.targets), the reward channels against the algorithm
    (`configured_channels`), and the pass channel."""
    check_targets(cfg.rewards, "rewards")
    for name, ch in cfg.rewards.channels.items():
        check_not_trl(ch.get("fn"), f"rewards.channels.{name}.fn")
    check_pass_channel(cfg.rewards, list(configured_channels(cfg.rewards, cfg.algo)[0]))


def configured_channels(rewards: Any, algo: Any) -> tuple[dict[str, Any], list[str]]:
    """({name: channel config} a run trains on, [names left out]), after checking every channel against `algo`.

    Left out: the entries a preset wrote for channels these rewards do not have (`algo.shapes`: they have no `fn`).
    Any other entry without `fn` is a misspelt or incomplete channel."""
    channels = {name: ch for name, ch in rewards.channels.items() if not OmegaConf.is_missing(ch, "fn")}
    left_out = [name for name in rewards.channels if name not in channels]
    names = list(channels)
    for name in left_out:
        if name not in algo.shapes:
            raise UserError(f"rewards.channels.{name} has no fn: rewards={rewards.name} has no channel {name!r} (its "
                            f"channels: {', '.join(names) or 'none'}); fix the name, or add the channel in your "
                            "rewards YAML with fn: {_target_: my_module.my_channel}")
    if not channels:
        raise UserError(f"rewards={rewards.name} defines no channels; give rewards.channels.<name>.fn")
    for name, ch in channels.items():
        for bound in CHANNEL_BOUNDS:
            bound.check(ch[bound.key], f"rewards.channels.{name}.{bound.key}")
        if ch.enforce is not None and ch.kind.value != "constraint":
            raise UserError(f"rewards.channels.{name}.enforce needs kind: constraint (it is {ch.kind.value}); set "
                            f"rewards.channels.{name}.kind=constraint or drop the enforce")
        check_budget(name, ch)
        if ch.condition_on is not None and ch.condition_on not in names:
            raise UserError(f"rewards.channels.{name}.condition_on={ch.condition_on!r} is not a channel; "
                            f"choose one of {names}")
    if algo.weights is not None:
        weights = dict(algo.weights)
        if set(weights) != set(names):
            extra, missing = sorted(set(weights) - set(names)), sorted(set(names) - set(weights))
            parts = [f"weights for {', '.join(extra)}, which rewards={rewards.name} does not have"] if extra else []
            parts += [f"no weight for {', '.join(missing)}"] if missing else []  # joined with ", and "
            raise UserError(
                f"algo.weights does not fit rewards={rewards.name}: algo={algo.name} gives {', and '.join(parts)}; "
                "give one weight per channel, e.g. "
                f"algo.weights={{{','.join(f'{n}:1' for n in names)}}}, or use a preset without weights (algo=grpo)")
        for name, weight in weights.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise UserError(f"algo.weights.{name}={weight!r}: weights must be finite numbers")
    return channels, left_out


def check_budget(name: str, ch: Any) -> None:
    """A channel's budget keys: set together with enforce: budget, and within their bounds."""
    key = f"rewards.channels.{name}"
    budgeted = ch.enforce is not None and ch.enforce.value == "budget"
    if budgeted and ch.budget is None:
        raise UserError(f"{key}.enforce=budget needs {key}.budget: the allowed expected cost per episode (minus the "
                        f"channel's mean value), e.g. {key}.budget=0.05 for a 5% violation rate")
    if not budgeted and ch.budget is not None:
        now = ch.enforce.value if ch.enforce is not None else None
        raise UserError(f"{key}.budget={ch.budget} needs {key}.enforce=budget (it is {now}); set "
                        f"{key}.enforce=budget, or drop the budget")
    if not budgeted:
        if ch.price.kind != PriceKind.integral or any(ch.price[k] is not None for k in PID_DEFAULTS):
            raise UserError(f"{key}.price prices a budget, and {key}.enforce is not budget: set "
                            f"{key}.enforce=budget and {key}.budget, or drop {key}.price")
        return
    Bound("budget", 0, fix="the allowed expected cost per episode, e.g. 0.05").check(ch.budget, f"{key}.budget")
    Bound("lambda_lr", 0, strict=True, fix="the dual step, e.g. 0.1").check(ch.lambda_lr, f"{key}.lambda_lr")
    Bound("lambda_max", 0, strict=True, fix="the price's cap, e.g. 10").check(ch.lambda_max, f"{key}.lambda_max")
    Bound("lambda_init", 0, ch.lambda_max, fix=f"a starting price within [0, {key}.lambda_max]").check(
        ch.lambda_init, f"{key}.lambda_init")
    check_price(key, ch)


def pid_gains(ch: Any) -> PidGains | None:
    """A budgeted channel's pid gains per unit of cost (the config's, relative to the budget, divided by it; an unset
    key takes PID_DEFAULTS), or None for an integral price or no budget."""
    if ch.enforce is None or ch.enforce.value != "budget" or ch.price.kind != PriceKind.pid:
        return None
    given = {key: ch.price[key] if ch.price[key] is not None else default for key, default in PID_DEFAULTS.items()}
    kp, ki, kd = absolute_gains(given["kp"], given["ki"], given["kd"], ch.budget)
    return PidGains(kp, ki, kd, given["ema"], int(given["delay"]), ch.lambda_max)


def check_price(key: str, ch: Any) -> None:
    """A budget's `price`: pid's keys only with kind pid, within their bounds, and a budget above 0 (its gains are
    relative to it)."""
    price, gains = ch.price, [k for k in PID_DEFAULTS if ch.price[k] is not None]
    if price.kind != PriceKind.pid:
        if gains:
            raise UserError(f"{key}.price.{gains[0]} is a pid price's setting, and {key}.price.kind is "
                            f"{price.kind.value}: set {key}.price.kind=pid, or drop {key}.price.{gains[0]}")
        return
    if not ch.budget > 0:
        raise UserError(f"{key}.price.kind=pid needs {key}.budget > 0 (it is {ch.budget:g}): its gains are relative to "
                        f"the budget; give a budget above 0, or use {key}.price.kind=integral")
    bounds = [Bound("kp", 0, fix="the proportional gain, e.g. 1"),
              Bound("ki", 0, fix="the integral gain, e.g. 0.005"),
              Bound("kd", 0, fix="the derivative gain, e.g. 0 or 0.1"),
              Bound("ema", 0, 1, below_high=True, fix="the EMA's weight on the past, e.g. 0.9"),
              Bound("delay", 1, fix="steps the derivative looks back, e.g. 10")]
    for bound in bounds:
        if price[bound.key] is not None:
            bound.check(price[bound.key], f"{key}.price.{bound.key}")


def check_pass_channel(rewards: Any, names: list[str]) -> None:
    """`rewards.pass_channel`, when set, is one of the task's channels (`names`)."""
    chosen = rewards.pass_channel
    if chosen is not None and chosen not in names:
        raise UserError(f"rewards.pass_channel={chosen!r} is not a channel of rewards={rewards.name}: choose one of "
                        f"{', '.join(names)} (an episode passes when it is >= 1), or null for no accuracy or pass@k")

"""A budget's price as a PID controller (Stooke, Achiam & Abbeel, "Responsive Safety in RL by PID Lagrangian Methods",
ICML 2020): pure functions on plain floats, the controller's memory passed in and handed back.

How it departs from the integral price (`mrl.algo.advantages.dual_step`, projected dual ascent): the integral term is
that very update; a proportional term on a smoothed cost answers at once to an excursion over the budget (and lets the
price fall at once when the cost drops below it), and a derivative term on the smoothed cost's rise over `delay` steps
pushes back while the cost is still climbing.  With kp = kd = 0 the price is the integral update exactly.  As in
Stooke et al. (and OmniSafe's `common/pid_lagrange.py`) the derivative only raises the price, and the integral term is
clamped to [0, cap] (no wind-up past the cap, none below 0).

The gains here are absolute (per unit of cost); the config states them relative to the budget d
(`rewards.channels.<c>.price`, docs/constraints.md) and `absolute_gains` divides them by d once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class PidGains:
    """A PID price's settings, in units of the cost: the price moves by `kp` per unit of the smoothed cost over the
    budget, by `ki` a step per unit of the step's cost over it, by `kd` per unit the smoothed cost rose over `delay`
    steps.  `ema`: the smoothing's weight on the past (c_bar <- ema * c_bar + (1 - ema) * cost).  `cap`: lambda_max."""

    kp: float
    ki: float
    kd: float
    ema: float
    delay: int
    cap: float


@dataclass(frozen=True)
class PidState:
    """A PID price between steps: the integral term, the cost's EMA (None before a step scored the channel), the EMAs
    of the last `delay` steps (oldest first), and the P and D terms of the price now paid (logged beside it)."""

    integral: float
    ema: float | None = None
    history: tuple[float, ...] = ()
    p: float = 0.0
    d: float = 0.0

    @property
    def price(self) -> float:
        """lambda = min(cap, max(0, P + I + D)) with the cap already applied to I: the caller caps (`pid_step`)."""
        return max(0.0, self.p + self.integral + self.d)

    def to_json(self) -> dict:
        return {"integral": self.integral, "ema": self.ema, "history": list(self.history), "p": self.p, "d": self.d}

    @classmethod
    def from_json(cls, saved: dict) -> PidState:
        """Exactly what `to_json` wrote (JSON floats round-trip)."""
        ema = saved["ema"]
        return cls(float(saved["integral"]), None if ema is None else float(ema),
                   tuple(float(v) for v in saved["history"]), float(saved["p"]), float(saved["d"]))


def absolute_gains(kp: float, ki: float, kd: float, budget: float) -> tuple[float, float, float]:
    """Gains relative to the budget d (the error as a fraction of d: e = (cost - d) / d) as gains per unit of cost:
    each divided by d, so that kp * e = (kp / d) * (cost - d).  d > 0 (the config refuses pid at d = 0).

    >>> absolute_gains(1.0, 0.01, 0.5, 0.25)
    (4.0, 0.04, 2.0)
    """
    return kp / budget, ki / budget, kd / budget


def pid_step(state: PidState, cost: float, budget: float, gains: PidGains) -> tuple[float, PidState]:
    """One step of the PID price from the step's mean cost J (NaN: no rollout scored the channel; nothing moves):

        c_bar = ema * c_bar + (1 - ema) * J        (c_bar = J at the first scored step)
        I     = min(cap, max(0, I + ki * (J - d)))  (dual_step's update on I: the integral price is kp = kd = 0)
        P     = kp * (c_bar - d)                    (negative below the budget: the price falls at once)
        D     = kd * max(0, c_bar - c_bar[delay steps ago])   (the oldest EMA kept while fewer steps have passed)
        lambda = min(cap, max(0, P + I + D))

    Returns (lambda for the next step, the state holding I, c_bar, the EMAs' history and P, D).

    >>> gains = PidGains(kp=2.0, ki=1.0, kd=4.0, ema=0.5, delay=1, cap=10.0)
    >>> lam, state = pid_step(PidState(integral=0.0), 0.5, 0.25, gains)  # c_bar 0.5; I 0.25; P 0.5; D 0
    >>> lam, state.integral, state.p, state.d
    (0.75, 0.25, 0.5, 0.0)
    >>> pid_step(state, 1.0, 0.25, gains)[0]  # c_bar 0.75; I 1.0; P 1.0; D 4 * (0.75 - 0.5) = 1.0
    3.0
    """
    if math.isnan(cost):
        return min(gains.cap, state.price), state
    ema = cost if state.ema is None else gains.ema * state.ema + (1.0 - gains.ema) * cost
    integral = min(gains.cap, max(0.0, state.integral + gains.ki * (cost - budget)))
    p = gains.kp * (ema - budget)
    past = state.history[0] if state.history else ema
    d = gains.kd * max(0.0, ema - past)
    history = (*state.history, ema)[-gains.delay:]
    new = replace(state, integral=integral, ema=ema, history=history, p=p, d=d)
    return min(gains.cap, new.price), new

"""A TRL reward function as a reward channel, unchanged:
`fn: {_target_: mrl.rewards.trl.TrlReward, fn: my_mod.correct}`.

TRL's GRPOTrainer calls each reward function once per batch as `f(prompts=..., completions=..., completion_ids=...,
**columns)` and reads back one float (or None) per completion; `TrlReward` makes that call once per scoring of a
step's rollouts (a batched channel, mrl.rewards.channels) and hands each episode its value.  In TRL's conventions:

- a *standard* prompt (a dataset record whose `prompt` is a string) gives strings: `prompts[i]` the prompt text,
  `completions[i]` the completion text;
- a *conversational* one (the record's `prompt`, or its `messages`, a list of turns) gives message lists:
  `prompts[i]` the turns, `completions[i]` `[{"role": "assistant", "content": text}]`;
- every other column of the record, one list entry per completion, as a keyword (`answer=[...]`, `solution=[...]`);
- None abstains (TRL: the function does not apply to that sample);
- each value is what `torch.tensor(values, dtype=torch.float32)` reads, as in TRL: a bool (1.0 or 0.0), an int or
  float, a NumPy scalar (`numpy.float32(0.5)`, `numpy.bool_(True)`) or a 0-d array or tensor.

What the function returns is read lazily, at most one value past the batch's size: an endless generator is a one-line
error (it "returned more than N values"), not a list that grows until the OOM killer ends the trainer.

TRL also passes `trainer_state`, `log_extra` and `log_metric`; mrl does not (a TRL function takes `**kwargs` and
ignores them).  No import of TRL: only its calling convention.

>>> def reward_len(completions, **kwargs):
...     return [-abs(5 - len(c)) for c in completions]
>>> from mrl.core.episode import Episode, Prompt
>>> TrlReward(reward_len)([Episode(Prompt("p"), "abc", [1, 2, 3], 3, False, 8)])
[-2]
"""

from __future__ import annotations

import numbers
from itertools import islice
from typing import Any, Callable

from mrl.core.episode import Episode
from mrl.rewards.targets import locate


class TrlReward:
    """A TRL reward function `fn` (a callable, or its dotted path) as a batched mrl channel.

    conversational: None (default) follows each prompt (message lists where the record's prompt was a list of
    turns, strings otherwise); true or false forces one form for every episode.
    """

    batched = True

    def __init__(self, fn: Callable | str, conversational: bool | None = None):
        self.fn = locate(fn, "fn") if isinstance(fn, str) else fn
        self.conversational = conversational

    def __call__(self, episodes: list[Episode]) -> list[Any]:
        values = self.fn(**trl_inputs(episodes, self.conversational))
        # one past the batch: the channel's count check names a long answer, and an endless one ends here
        return [trl_value(v) for v in islice(values, len(episodes) + 1)]


def trl_value(value: Any) -> Any:
    """A value as TRL reads it (`torch.tensor(values, dtype=torch.float32)`): a bool, a NumPy scalar or a 0-d array
    or tensor as its Python number; anything else as it is (the channel refuses what is not a finite number).

    >>> import numpy as np
    >>> [trl_value(v) for v in (True, np.float32(0.5), np.bool_(False), np.array(2), 3, None)]
    [1.0, 0.5, 0.0, 2, 3, None]
    """
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) and (isinstance(value, numbers.Real) or getattr(value, "ndim", None) == 0):
        item = getattr(value, "item", None)
        value = item() if callable(item) else float(value)
        return float(value) if isinstance(value, bool) else value
    return value


def trl_inputs(episodes: list[Episode], conversational: bool | None = None) -> dict[str, list]:
    """The keywords TRL's GRPOTrainer passes a reward function, for these episodes: prompts, completions,
    completion_ids and one list per record column (a column a record lacks is None there).

    >>> from mrl.core.episode import Prompt
    >>> chat = Prompt("2+2?", {"answer": "4"}, messages=[{"role": "user", "content": "2+2?"}])
    >>> inputs = trl_inputs([Episode(chat, "4", [19], 1, False, 8)])
    >>> inputs["prompts"], inputs["completions"], inputs["answer"]
    ([[{'role': 'user', 'content': '2+2?'}]], [[{'role': 'assistant', 'content': '4'}]], ['4'])
    """
    columns = sorted({key for e in episodes for key in e.prompt.meta if key not in ("completion", "completion_ids")})
    prompts, completions = [], []
    for e in episodes:
        chat = bool(e.prompt.messages) if conversational is None else conversational
        prompts.append([dict(m) for m in e.prompt.chat()] if chat else e.prompt.text)
        completions.append([{"role": "assistant", "content": e.completion}] if chat else e.completion)
    return {"prompts": prompts, "completions": completions,
            "completion_ids": [list(e.completion_ids) for e in episodes],
            **{key: [e.prompt.meta.get(key) for e in episodes] for key in columns}}

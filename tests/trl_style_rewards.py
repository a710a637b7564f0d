"""Reward functions written the way TRL's docs write them (the reward-function section of its GRPOTrainer page:
a length reward, a format reward by regex, an accuracy reward against a dataset column), for mrl's TRL adapter
(mrl.rewards.trl.TrlReward) to call unchanged.  Our own text, in TRL's calling convention."""

import re


def reward_len(completions, **kwargs):
    """Closer to 10 characters is better: -|10 - len|."""
    return [-abs(10 - len(completion)) for completion in completions]


def format_reward(completions, **kwargs):
    """1.0 for `<think>...</think><answer>...</answer>`, conversational completions (message lists)."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, content) else 0.0 for content in contents]


def accuracy_reward(completions, solution, **kwargs):
    """1.0 where the completion's last number is the `solution` column's; None (abstain) for a row without one."""
    rewards = []
    for completion, sol in zip(completions, solution):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        numbers = re.findall(r"-?\d+", text)
        rewards.append(None if sol is None else float(bool(numbers) and numbers[-1] == sol))
    return rewards


def seen(prompts, completions, completion_ids, **kwargs):
    """Every keyword TRL passes, echoed into one number per completion: len(prompt) + 10 * len(ids) + 100 * columns."""
    return [len(p) + 10 * len(ids) + 100 * len(kwargs) for p, ids in zip(prompts, completion_ids)]

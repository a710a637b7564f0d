"""BFCL's graders, by their documented names: single-turn `grade` (mrl.envs.bfcl.grader) and multi-turn `replay`
(mrl.envs.bfcl_agent.gym)."""

from mrl.envs.bfcl.grader import CATEGORIES, explain, gold_calls, grade, load_entries, messages
from mrl.envs.bfcl_agent.gym import replay

__all__ = ["CATEGORIES", "explain", "gold_calls", "grade", "load_entries", "messages", "replay"]

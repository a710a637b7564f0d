"""HumanEval's grader, by its documented name: `grade` (mrl.envs.humaneval)."""

from mrl.envs.humaneval import LIMITS, HumanEvalTask, grade, load_problems, problem_tests, program

__all__ = ["LIMITS", "HumanEvalTask", "grade", "load_problems", "problem_tests", "program"]

"""The trainers' maths, pure tensor functions with their shapes documented, and the one registry that names them.

  algos.py       the estimators' registry: what makes PPO, GRPO, DAPO and GDPO differ
  advantages.py  advantage estimators (group-normalized, per-channel GDPO, GAE) and live groups
  shaping.py     constraints applied to rewards: condition, veto, drop
  losses.py      the policy and value losses and their aggregations
"""

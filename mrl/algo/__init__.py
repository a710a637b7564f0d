"""The trainers' maths, pure tensor functions with their shapes documented, and the one registry that names them.

  algos.py       an algorithm's settings checked against its estimator and the trainer, before a run starts
  advantages.py  advantage estimators (group-normalized, per-channel GDPO, GAE) and live groups, and ESTIMATORS,
                 the registry they join where they are defined (@estimator): what makes PPO, GRPO, DAPO, GDPO differ
  shaping.py     constraints applied to rewards: condition, veto, drop
  losses.py      the policy and value losses and their aggregations
  prices.py      a budget's price as a PID controller, on plain floats
"""

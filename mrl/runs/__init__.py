"""A run on disk: its directory, checkpoints, metrics and reports, and what may be trusted from one.

  rundir.py      the run dir: its lock, atomic writes, intact checkpoints
  checkpoint.py  saving a step's checkpoint
  restore.py     a policy back from a checkpoint (to evaluate, export, or start from)
  warm_start.py  RL from another run's checkpoint, with lineage
  trust.py       which run dir configs may be built (their `_target_`s) and how moved names are read
  tracking.py    metrics.jsonl, W&B, the progress line
  report.py      reports of runs: tables, plots, interactive HTML
  export.py      `mrl export`: a run's policy as a plain HF model dir
"""

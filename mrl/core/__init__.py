"""The floor everything stands on: plain data and the rules every layer shares, no model and no I/O of a run.

  config.py       the schemas of every config group, `Registry`, `UserError`, bounded config fields
  safe_json.py    JSON from outside (a tool call, a record) read with its size, nesting and numbers bounded
  stats.py        seeds, means and standard errors
  episode.py      `Prompt` and `Episode`: what a reward channel reads
  distributed.py  ranks: who decides, gathering rows, leaving cleanly under a launcher
  data.py         prompts from a local dataset (JSONL, Parquet, a saved HF dataset), split train/eval
"""

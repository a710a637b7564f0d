"""Reproductions of the seeds' claims: `make repro-<name>` -> reports/<name>/ (PNG, CSV, summary.md with a verdict).

Each target runs `mrl train` itself (a Hydra multirun) or, for `collapse`, only the project's advantage functions.
`SCALE=gpu` switches the training targets to a real model preset.
"""

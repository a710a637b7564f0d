"""mrl: multi-reward RL for LLM agents.  The packages, top to bottom (pyproject.toml's import contract):

  cli.py, repro/    the commands and the reproductions
  overrides.py      the command line before Hydra
  train/            the RL loop and its phases, SFT, held-out evaluation
  runs/ generation/ envs/ rewards/
                    a run on disk; generating rollouts; the environments and what a task is; reward channels
  chat/ sandbox/ modeling/
                    conversations as tokens; running generated code; the policy and what trains it
  algo/             the trainers' maths
  core/             schemas, plain data, ranks
"""

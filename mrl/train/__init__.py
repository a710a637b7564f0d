"""Training and evaluating: the RL loop and its phases, supervised fine-tuning, held-out evaluation.

  loop.py            `mrl train`: `train()` as named phases, `train_step` as five calls
  collect.py         a step's rollouts collected and scored
  batch.py           StepBatch, the step's one record; where the ranks meet (lockstep, every_rank)
  update.py          the policy update over micro-batches
  sft.py             `mrl sft`: supervised fine-tuning on demonstrations, built from the loop's parts
  demonstrations.py  solved episodes played into token rows
  evaluate.py        held-out scoring (in a run, and `mrl eval`)
  validation.py      a run's config checked before anything is written
"""

"""Reward channels: building, scoring and shaping them (channels.py).  A channel is a plain callable on one Episode
returning a float; each environment's own live in its module (mrl.envs.<name>).

Build one in YAML with `_target_` under `rewards.channels.<name>.fn`; the channel's name is its key there.  A TRL
reward function is a channel through its adapter (trl.py); every `_target_` is imported while the config is
validated (targets.py).
"""

"""Reward channels: plain callables on one Episode returning a float.

Build one in YAML with `_target_` under `rewards.channels.<name>.fn`; the channel's name is its key there.
"""

"""Environments: one module (or a small package) per `rewards=<name>`, holding all of it: the task (prompts, tools,
the stateful world an episode runs in), its reward channels, its grader and its demonstrations.
`conf/rewards/<name>.yaml` names the task and the channels with `_target_`; nothing else refers to them.

The generic parts stay elsewhere: what a task is and how a run builds one (mrl.envs.task), a task's fixed train/eval
split served as a stream (mrl.core.data.SplitPrompts), building and shaping channels (mrl.rewards.channels), and running
code (mrl.sandbox).
"""

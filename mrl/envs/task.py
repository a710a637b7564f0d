"""Tasks: where prompts come from, and the environment an episode runs in.

A task is any object with `prompt(index) -> mrl.core.episode.Prompt` (the same index always gives the same prompt).
Optional attributes make it an agent environment: `tools` ({name: mrl.chat.protocols.Tool}), `max_turns`,
`answer_words` (words protocol: words that end the episode once the transcript holds one), and `parallel_calls`
(chat protocol: a turn's calls are the answer and a turn may hold several; tasks whose tools never run; their
prompts may carry an `answer_prefix`), and `environment(prompt)` (chat protocol: a new stateful world per episode,
mrl.chat.protocols.Environment: tools acting on state, a user who speaks several times; BFCL multi-turn).  A prompt's
own `tools` (a dataset record's, BFCL's) replace the task's for its episodes.  Which protocol the
episodes follow, the tiny model's words or the model's own chat format, is the model's choice (`model.tool_format`).

The built-in tasks live with their channels in mrl.envs (one home per environment); this module builds the
configured one (`rewards.task`, fed from `data.path` when given), its protocol, its held-out prompts, and checks
the dataset a run reads.
"""

from __future__ import annotations

import json
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from mrl.chat.protocols import ProtocolSettings, ToolProtocol, make_protocol
from mrl.core.config import UserError
from mrl.core.data import DatasetTask, dataset_file
from mrl.core.episode import Prompt


class DatasetPrompts:
    """A task whose prompts come from a dataset, with the rules of a built-in task: its turn limit, answer words and
    the tools that run (the environment, e.g. calc_agent's calculator).  The built-in task's declared-only tools
    (tool_call's calc and lookup: answers of its own generator) never reach a dataset's episodes: a record declares
    its own (`tools`), or the base task's `dataset_prompt(prompt)` completes the record (tool_call: the called tool
    alone)."""

    def __init__(self, base: Any, dataset: DatasetTask):
        self.base, self.dataset = base, dataset
        self.tools = {name: tool for name, tool in (getattr(base, "tools", None) or {}).items() if tool.fn is not None}

    def prompt(self, index: int) -> Prompt:
        return self._completed(self.dataset.prompt(index))

    def eval_prompts(self) -> list[Prompt]:
        return [self._completed(p) for p in self.dataset.eval_prompts()]

    def _completed(self, prompt: Prompt) -> Prompt:
        complete = getattr(self.base, "dataset_prompt", None)
        return complete(prompt) if complete is not None else prompt

    def __getattr__(self, name: str) -> Any:  # max_turns, answer_words, parallel_calls: the base task's
        return getattr(self.base, name)


def has_task(rewards: Any) -> bool:
    """Whether the rewards preset names a task; one that lists channels alone trains on `data.path` (`build_task`)."""
    return not OmegaConf.is_missing(rewards, "task") and rewards.task is not None


def dataset_task(cfg: Any, required: tuple[str, ...] = ()) -> DatasetTask:
    """`data.path`'s prompts, split by trainer.seed (`mrl sft`: its conversations' prompts)."""
    return DatasetTask(cfg.data.path, seed=cfg.trainer.seed, eval_fraction=cfg.data.eval_fraction,
                       text_field=cfg.data.text_field, required=required,
                       conversations=cfg.get("stage", "rl") == "sft")


def build_task(cfg: Any) -> Any:
    """The configured task (`rewards.task`), fed from `data.path` when one is given; without a task (a preset of
    channels alone), `data.path`'s prompts as they are."""
    if not has_task(cfg.rewards):
        return dataset_task(cfg)
    task = instantiate(cfg.rewards.task)
    if cfg.data.path:
        task = DatasetPrompts(task, dataset_task(cfg, getattr(task, "record_fields", ())))
    return task


def episode_protocol(cfg: Any, tokenizer, task: Any) -> ToolProtocol:
    """How episodes of `task` run with this tokenizer (mrl.generation.rollout.generate's `protocol`): the words or chat
    protocol (`model.tool_format`), with the task's tools, turn limit and answer words."""
    model = cfg.model
    kwargs = model.chat_template_kwargs
    kwargs = OmegaConf.to_container(kwargs, resolve=True) if isinstance(kwargs, DictConfig) else dict(kwargs or {})
    return make_protocol(tokenizer, model.tool_format, ProtocolSettings(
        model.use_chat_template, kwargs, getattr(task, "tools", None) or {}, getattr(task, "max_turns", 1),
        tuple(getattr(task, "answer_words", ())), cfg.trainer.max_tool_tokens, getattr(task, "parallel_calls", False),
        getattr(task, "environment", None)))


def held_out_prompts(task: Any, count: int) -> list[Prompt]:
    """Prompts never trained on: a dataset's eval split, or a generator's negative indices (training uses 0, 1, ...)."""
    if hasattr(task, "eval_prompts"):
        return task.eval_prompts()[:count]
    return [task.prompt(-1 - i) for i in range(count)]


# A token of a BPE vocabulary rarely spans more characters than this: a longer prompt cannot fit the context.
CHARS_PER_TOKEN = 16


def check(cfg) -> None:
    """The dataset a run reads (`data.path`), read as the run will, before Hydra creates the run dir.  (`mrl sft`
    reads it as conversations instead: mrl.train.demonstrations.check.)"""
    if not has_task(cfg.rewards) and not cfg.data.path:
        raise UserError(f"rewards={cfg.rewards.name} names no task and data.path is not set: give data.path=FILE "
                        "(.jsonl, .parquet, a save_to_disk dir or a Hub id: its prompts are the task), or "
                        "rewards.task._target_=my_module.MyTask")
    if cfg.data.path and cfg.get("stage", "rl") != "sft":
        from mrl.modeling.models import (
            context_length,  # start-up time: mrl.modeling.models imports torch, the tasks do not
        )

        dataset_file(cfg.data.path)
        _check_dataset(cfg, context_length(cfg.model))


def _check_dataset(cfg: DictConfig, context: int | None) -> None:
    """Read the dataset as the run will, before Hydra creates the run dir: an empty file, a record without its
    prompt, or a prompt no context can hold is refused here, with nothing written."""
    from hydra.utils import get_class  # the task's class, not the task: building one may read a benchmark

    try:
        required = getattr(get_class(cfg.rewards.task._target_), "record_fields", ()) if has_task(cfg.rewards) else ()
    except Exception:  # an unknown target is refused where the task is built, naming it
        required = ()
    task = dataset_task(cfg, required)
    if context is None:
        return
    limit = context * CHARS_PER_TOKEN
    for prompt in [*task.split.train, *task.split.eval]:
        # What the template renders: the text, every turn, and the tools' declarations (a 3 MB schema reached the
        # OOM killer when it was not counted).
        turns = [len(str(m.get("content") or "")) + len(json.dumps(m.get("tool_calls") or [], default=str))
                 for m in prompt.messages or ()]
        chars = len(prompt.text) + sum(turns) + len(json.dumps(prompt.tools or [], default=str))
        if chars > limit:
            raise UserError(f"dataset {cfg.data.path!r}: a prompt of {chars} characters with its turns and tools "
                            f"({prompt.text[:40]!r}...) "
                            f"cannot fit the model's context of {context} tokens (at most ~{limit} characters): "
                            "shorten it or drop the record")

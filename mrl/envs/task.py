"""Tasks: where prompts come from, and the environment an episode runs in.

A task is a `Task`: `prompt(index) -> mrl.core.episode.Prompt` (the same index always gives the same prompt) is all it
must have; `TaskBase` gives every other member its default, and a task overrides those it needs: `tools`
({name: mrl.chat.protocols.Tool}), `max_turns`, `answer_words` (words protocol), `parallel_calls` (chat protocol: a
turn's calls are the answer), `environment(prompt)` (chat protocol: a new stateful world per episode,
mrl.chat.protocols.Environment; BFCL multi-turn), held-out `eval_prompts()`, `demonstrations(split, count)` for
`mrl sft`, and for `data.path` its `record_fields` and `dataset_prompt(prompt)`.  A prompt's own `tools` (a dataset
record's, BFCL's) replace the task's for its episodes.  Which protocol the episodes follow, the tiny model's words or
the model's own chat format, is the model's choice (`model.tool_format`).  A task need not subclass TaskBase: one
that does not gets the base's defaults for what it lacks (`as_task`); one without `prompt` is refused in one line.

The built-in tasks live with their channels in mrl.envs (one home per environment); this module builds the
configured one (`rewards.task`, fed from `data.path` when given), its protocol, its held-out prompts, and checks
the dataset a run reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from mrl.chat.protocols import Environment, ProtocolSettings, Tool, ToolProtocol, make_protocol
from mrl.core.config import UserError
from mrl.core.data import DatasetTask, dataset_file
from mrl.core.episode import Demonstration, Prompt


@runtime_checkable
class Task(Protocol):
    """What a run reads of its task.  Only `prompt` is required of a user's task: TaskBase holds the defaults of the
    rest (docs/extending.md, "Writing a task")."""

    tools: Mapping[str, Tool]
    max_turns: int
    answer_words: tuple[str, ...]
    parallel_calls: bool
    environment: Callable[[Prompt], Environment] | None
    record_fields: tuple[str, ...]
    no_demonstrations: str

    def prompt(self, index: int) -> Prompt:
        """Train prompt number `index` (0, 1, ...); the same index always gives the same prompt."""
        ...

    def eval_prompts(self) -> list[Prompt] | None:
        """The held-out prompts, never served by `prompt`; None: a generator's, `prompt(-1), prompt(-2), ...`."""
        ...

    def demonstrations(self, split: str = "train", count: int = 256) -> list[Demonstration]:
        """Solved episodes of `split` for `mrl sft`: a generator's first `count`, a fixed set's every one."""
        ...

    def dataset_prompt(self, prompt: Prompt) -> Prompt:
        """A `data.path` record's prompt completed for this task's rules."""
        ...


class TaskBase:
    """A Task's optional members with their defaults (a plain prompt generator: one turn, no tools, no held-out split
    but negative indices, no demonstrations); a subclass writes `prompt(index)` and overrides what it needs."""

    tools: Mapping[str, Tool] = MappingProxyType({})  # the policy's tools; one with `fn` runs, one without is declared
    max_turns: int = 1  # policy turns an episode may take (a tool call ends a turn)
    answer_words: tuple[str, ...] = ()  # words protocol: a transcript holding one of these words ends the episode
    parallel_calls: bool = False  # chat protocol: a turn's calls are the answer, several in a turn; none runs
    environment: Callable[[Prompt], Environment] | None = None  # chat protocol: a new stateful world per episode
    record_fields: tuple[str, ...] = ()  # what every `data.path` record must hold: the fields the channels read
    no_demonstrations: str = "it has no solved episodes to learn from"  # why `demonstrations` gives none

    def eval_prompts(self) -> list[Prompt] | None:
        """The held-out prompts; None: a generator's, `prompt(-1), prompt(-2), ...` (training uses 0, 1, ...)."""
        return None

    def demonstrations(self, split: str = "train", count: int = 256) -> list[Demonstration]:
        """Solved episodes of `split` for `mrl sft` (a generator's first `count`); none here, said in one line."""
        raise UserError(f"rewards.task {self} gives no demonstrations: {self.no_demonstrations}; choose a task "
                        "that has them (bfcl, bfcl_agent, calc_agent, agent_triple, tool_call) or give your own "
                        "conversations with data.path=FILE.jsonl")

    def dataset_prompt(self, prompt: Prompt) -> Prompt:
        """A `data.path` record's prompt completed for this task's rules (tool_call: the called tool declared); as it
        is here."""
        return prompt

    def __str__(self) -> str:
        return type(self).__name__


# What each optional member must be: a wrong one is refused when the run is checked (a class's members) or the task
# is built (those its __init__ sets), in one line.
MEMBERS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (lambda v: isinstance(v, Mapping), "a dict {name: mrl.chat.protocols.Tool}"),
    "max_turns": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                  "an int >= 1, the policy turns an episode may take"),
    "answer_words": (lambda v: isinstance(v, (tuple, list)), "a tuple of words"),
    "parallel_calls": (lambda v: isinstance(v, bool), "True or False"),
    "record_fields": (lambda v: isinstance(v, (tuple, list)), "a tuple of field names"),
    "no_demonstrations": (lambda v: isinstance(v, str), "a sentence saying why the task has no demonstrations"),
    "eval_prompts": (callable, "a method"),
    "demonstrations": (callable, "a method"),
    "dataset_prompt": (callable, "a method"),
    "environment": (lambda v: v is None or callable(v), "a method, or None"),
}


def check_task(task: object) -> None:
    """Refuse a task (its class or itself) without `prompt(index)`, or with an optional member of the wrong kind, in
    one line naming the class, the member and the fix.  A class's properties are checked on the task, once built."""
    cls = task if isinstance(task, type) else type(task)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if not callable(getattr(task, "prompt", None)):
        raise UserError(f"task {name} has no `prompt(index)`: add it, or subclass mrl.envs.task.TaskBase")
    for member, (fits, what) in MEMBERS.items():
        if not hasattr(task, member):
            continue
        value = getattr(task, member)
        if not fits(value) and not (task is cls and hasattr(type(value), "__get__")):
            raise UserError(f"task {name}'s `{member}` is {value!r}, not {what}: fix it, or leave it out for "
                            "mrl.envs.task.TaskBase's default")


class UserTask(TaskBase):
    """A task that does not subclass TaskBase, as a Task: its own `prompt` and optional members, the base's defaults
    for those it lacks (the task itself: `.task`)."""

    def __init__(self, task: object):
        self.task = task
        for member in ("prompt", *MEMBERS):
            if hasattr(task, member):
                setattr(self, member, getattr(task, member))

    def __str__(self) -> str:
        return type(self.task).__name__


def as_task(task: object) -> Task:
    """`task` checked (check_task) and as a Task: a TaskBase as it is, another object as a UserTask."""
    check_task(task)
    return task if isinstance(task, TaskBase) else UserTask(task)


class DatasetPrompts(TaskBase):
    """A task whose prompts come from a dataset, with the rules of a built-in task: its turn limit, answer words and
    the tools that run (the environment, e.g. calc_agent's calculator).  The built-in task's declared-only tools
    (tool_call's calc and lookup: answers of its own generator) never reach a dataset's episodes: a record declares
    its own (`tools`), or the base task's `dataset_prompt(prompt)` completes the record (tool_call: the called tool
    alone).  A preset of channels alone reads its dataset with TaskBase()'s rules: one turn, no tools."""

    no_demonstrations = "a dataset's prompts come without solved episodes (mrl sft reads data.path's conversations)"

    def __init__(self, base: TaskBase, dataset: DatasetTask):
        self.base, self.dataset = base, dataset
        self.tools = {name: tool for name, tool in base.tools.items() if tool.fn is not None}
        self.max_turns, self.answer_words, self.parallel_calls = base.max_turns, base.answer_words, base.parallel_calls
        self.environment, self.record_fields = base.environment, base.record_fields

    def prompt(self, index: int) -> Prompt:
        return self.base.dataset_prompt(self.dataset.prompt(index))

    def eval_prompts(self) -> list[Prompt]:
        return [self.base.dataset_prompt(p) for p in self.dataset.eval_prompts()]


def has_task(rewards: Any) -> bool:
    """Whether the rewards preset names a task; one that lists channels alone trains on `data.path` (`build_task`)."""
    return not OmegaConf.is_missing(rewards, "task") and rewards.task is not None


def dataset_task(cfg: Any, required: tuple[str, ...] = ()) -> DatasetTask:
    """`data.path`'s prompts, split by trainer.seed (`mrl sft`: its conversations' prompts)."""
    return DatasetTask(cfg.data.path, seed=cfg.trainer.seed, eval_fraction=cfg.data.eval_fraction,
                       text_field=cfg.data.text_field, required=required,
                       conversations=cfg.get("stage", "rl") == "sft")


def build_task(cfg: Any, dataset: bool = True) -> Task:
    """The configured task (`rewards.task`, as_task), fed from `data.path` when one is given (dataset=False: `mrl
    sft`'s, whose data.path holds conversations, keeps its own prompts); without a task (a preset of channels
    alone), `data.path`'s prompts with TaskBase's rules."""
    if not has_task(cfg.rewards):
        return DatasetPrompts(TaskBase(), dataset_task(cfg))
    task = as_task(instantiate(cfg.rewards.task))
    if cfg.data.path and dataset:
        return DatasetPrompts(task, dataset_task(cfg, task.record_fields))
    return task


def episode_protocol(cfg: Any, tokenizer, task: Task) -> ToolProtocol:
    """How episodes of `task` run with this tokenizer (mrl.generation.rollout.generate's `protocol`): the words or chat
    protocol (`model.tool_format`), with the task's tools, turn limit and answer words."""
    model = cfg.model
    kwargs = model.chat_template_kwargs
    kwargs = OmegaConf.to_container(kwargs, resolve=True) if isinstance(kwargs, DictConfig) else dict(kwargs or {})
    return make_protocol(tokenizer, model.tool_format, ProtocolSettings(
        model.use_chat_template, kwargs, dict(task.tools), task.max_turns, tuple(task.answer_words),
        cfg.trainer.max_tool_tokens, task.parallel_calls, task.environment))


def held_out_prompts(task: Task, count: int) -> list[Prompt]:
    """Prompts never trained on: a dataset's eval split, or a generator's negative indices (training uses 0, 1, ...)."""
    held_out = task.eval_prompts()
    return held_out[:count] if held_out is not None else [task.prompt(-1 - i) for i in range(count)]


# A token of a BPE vocabulary rarely spans more characters than this: a longer prompt cannot fit the context.
CHARS_PER_TOKEN = 16


def check(cfg) -> None:
    """The dataset a run reads (`data.path`), read as the run will, before Hydra creates the run dir.  (`mrl sft`
    reads it as conversations instead: mrl.train.demonstrations.check.)"""
    if not has_task(cfg.rewards) and not cfg.data.path:
        raise UserError(f"rewards={cfg.rewards.name} names no task and data.path is not set: give data.path=FILE "
                        "(.jsonl, .parquet, a save_to_disk dir or a Hub id: its prompts are the task), or "
                        "rewards.task._target_=my_module.MyTask")
    task_class = _task_class(cfg)
    if task_class is not None:
        check_task(task_class)
    if cfg.data.path and cfg.get("stage", "rl") != "sft":
        # Start-up time: mrl.modeling.models imports torch, the tasks do not.
        from mrl.modeling.models import context_length

        dataset_file(cfg.data.path)
        required = getattr(task_class, "record_fields", TaskBase.record_fields)  # None (no task): ()
        _check_dataset(cfg, tuple(required), context_length(cfg.model))


def _task_class(cfg: DictConfig) -> type | None:
    """The class `rewards.task` names, or None: no task, or a target that is no class (an unknown one is refused
    where the task is built, naming it; a factory function's task is checked there)."""
    from hydra.utils import get_class  # the task's class, not the task: building one may read a benchmark

    try:
        return get_class(cfg.rewards.task._target_) if has_task(cfg.rewards) else None
    except Exception:
        return None


def _check_dataset(cfg: DictConfig, required: tuple[str, ...], context: int | None) -> None:
    """Read the dataset as the run will, before Hydra creates the run dir: an empty file, a record without its
    `required` fields or its prompt, or a prompt no context can hold is refused here, with nothing written."""
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

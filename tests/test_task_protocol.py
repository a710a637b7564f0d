"""A declared Task: what every task must have (`prompt`), what it may add (TaskBase's defaults), and the one line a
user's task without a required member, or with an optional one of the wrong kind, is refused with."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_config
from hydra.utils import get_class
from omegaconf import OmegaConf

import mrl.envs
import mrl.envs.task
import mrl.train.demonstrations
from mrl.core.config import CONF_DIR, UserError
from mrl.core.data import DatasetTask
from mrl.core.episode import Prompt
from mrl.envs.calc_agent import CalcAgent
from mrl.envs.task import DatasetPrompts, Task, TaskBase, UserTask, as_task, build_task, check_task, episode_protocol
from mrl.envs.tool_call import ToolCallTask
from mrl.train.validation import validate

TESTS = Path(__file__).resolve().parent
TEST_CONF = TESTS / "conf"
HERE = Path(__file__).stem  # this module, as Hydra imports a user's task from it


class NoPrompt:
    def prompts(self, index: int) -> Prompt:  # a typo: `prompts`
        return Prompt("add 1 2 =")


class WrongTurns:
    max_turns = "3"

    def prompt(self, index: int) -> Prompt:
        return Prompt("add 1 2 =")


class Plain:
    """A user's task that does not subclass TaskBase: `prompt`, and two optional members of its own."""

    answer_words = ["1", "2"]

    def __init__(self, seed: int = 0, turns: int = 2):
        self.seed, self.max_turns = seed, turns

    def prompt(self, index: int) -> Prompt:
        return Prompt(f"add {index} {self.seed} =", meta={"target": index + self.seed})


def test_a_task_without_prompt_is_refused_in_one_line_when_the_run_is_checked():
    with pytest.raises(UserError) as err:
        validate(compose_config(f"rewards.task._target_={HERE}.NoPrompt"))  # before Hydra creates the run dir
    assert str(err.value) == (f"task {HERE}.NoPrompt has no `prompt(index)`: add it, or subclass "
                              "mrl.envs.task.TaskBase")
    with pytest.raises(UserError, match=r"^task test_task_protocol.NoPrompt has no `prompt\(index\)`"):
        as_task(NoPrompt())  # a factory's task, checked where it is built


def test_the_user_sees_one_line_and_nothing_is_written(tmp_path):
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "mrl", "train", f"rewards.task._target_={HERE}.NoPrompt"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=environ)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"mrl: error: task {HERE}.NoPrompt has no `prompt(index)`: add it, or subclass mrl.envs.task.TaskBase"]
    assert list(tmp_path.iterdir()) == []


def test_an_optional_member_of_the_wrong_kind_is_refused_naming_it():
    with pytest.raises(UserError) as err:
        validate(compose_config(f"rewards.task._target_={HERE}.WrongTurns"))
    assert str(err.value) == (f"task {HERE}.WrongTurns's `max_turns` is '3', not an int >= 1, the policy turns an "
                              "episode may take: fix it, or leave it out for mrl.envs.task.TaskBase's default")
    with pytest.raises(UserError, match=r"^task test_task_protocol.Plain's `max_turns` is 0, not an int >= 1"):
        as_task(Plain(turns=0))  # set by __init__: refused where the task is built
    with pytest.raises(UserError, match=r"`environment` is 7, not a method, or None"):
        check_task(type("Env", (TaskBase,), {"prompt": Plain.prompt, "environment": 7}))
    with pytest.raises(UserError, match=r"`tools` is None, not a dict"):
        as_task(type("NoTools", (), {"prompt": Plain.prompt, "tools": None})())


def test_a_property_is_checked_on_the_built_task_not_on_its_class():
    class Turns:
        def prompt(self, index: int) -> Prompt:
            return Prompt("add 1 2 =")

        @property
        def max_turns(self) -> int:
            return 4

    check_task(Turns)  # the class holds a property, not an int
    assert as_task(Turns()).max_turns == 4


def test_a_users_task_without_the_base_builds_with_the_bases_defaults(tokenizer):
    cfg = compose_config("rewards=math_length", "algo=gdpo", f"rewards.task._target_={HERE}.Plain",
                         "rewards.task.seed=5")
    validate(cfg)
    task = build_task(cfg)
    assert isinstance(task, UserTask) and isinstance(task, Task) and isinstance(task.task, Plain)
    assert task.prompt(3) == Prompt("add 3 5 =", meta={"target": 8})
    assert (task.max_turns, task.answer_words) == (2, ["1", "2"])  # its own
    assert (dict(task.tools), task.parallel_calls, task.environment, task.record_fields) == ({}, False, None, ())
    assert mrl.envs.task.held_out_prompts(task, 2) == [Prompt("add -1 5 =", meta={"target": 4}),
                                                   Prompt("add -2 5 =", meta={"target": 3})]
    protocol = episode_protocol(cfg, tokenizer, task)
    assert (protocol.max_turns, protocol.answer_words, protocol.tools) == (2, ("1", "2"), {})
    with pytest.raises(UserError, match=r"^rewards.task Plain gives no demonstrations: it has no solved episodes"):
        task.demonstrations("train", 4)


def test_an_environment_added_from_outside_mrl_is_a_task():
    """tests/parity_env.py: a plain class with `prompt` alone (test_envs trains two steps on it)."""
    task = build_task(compose_config(f"hydra.searchpath=[file://{TEST_CONF}]", "rewards=parity", "algo=gdpo"))
    assert isinstance(task, UserTask) and str(task) == "ParityTask" and task.max_turns == 1


def test_the_bases_defaults():
    base, prompt = TaskBase(), Prompt("add 1 2 =")
    assert (dict(base.tools), base.max_turns, base.answer_words, base.parallel_calls, base.environment,
            base.record_fields) == ({}, 1, (), False, None, ())
    assert base.eval_prompts() is None and base.dataset_prompt(prompt) is prompt
    with pytest.raises(TypeError):
        base.tools["calc"] = None  # one default shared by every task: read-only
    with pytest.raises(UserError) as err:
        base.demonstrations()
    assert str(err.value) == ("rewards.task TaskBase gives no demonstrations: it has no solved episodes to learn "
                              "from; choose a task that has them (bfcl, bfcl_agent, calc_agent, agent_triple, "
                              "tool_call) or give your own conversations with data.path=FILE.jsonl")


def _built_in_tasks() -> dict[str, str]:
    """{task class: the first rewards preset naming it}, over conf/rewards."""
    presets = {path.stem: OmegaConf.load(path) for path in sorted((CONF_DIR / "rewards").glob("*.yaml"))}
    tasks: dict[str, str] = {}
    for name, preset in presets.items():
        if preset.get("task") is not None:
            tasks.setdefault(preset.task._target_, name)
    return tasks


@pytest.mark.parametrize("target, preset", sorted(_built_in_tasks().items()))
def test_every_built_in_environment_is_a_task(target, preset):
    cls = get_class(target)
    assert issubclass(cls, TaskBase) and "prompt" in vars(cls)
    check_task(cls)
    task = build_task(compose_config(f"rewards={preset}", "algo=gdpo"))
    assert type(task) is cls and isinstance(task, Task)  # itself: no adapter
    check_task(task)


def test_the_built_in_tasks_cover_every_environment():
    """Each module or package of mrl/envs but task.py (what a task is) is some preset's task: the test above sees
    every built-in task."""
    envs = {path.stem for path in Path(mrl.envs.__file__).parent.iterdir() if not path.name.startswith("_")} - {"task"}
    assert {target.split(".")[2] for target in _built_in_tasks()} == envs


def test_a_dataset_task_declares_the_base_tasks_rules_and_no_demonstrations(tmp_path):
    data = tmp_path / "sums.jsonl"
    data.write_text('{"prompt": "add 1 2 =", "target": 3, "a": 1, "b": 2}\n')
    task = DatasetPrompts(CalcAgent(max_turns=4), DatasetTask(str(data), eval_fraction=0))
    assert isinstance(task, Task) and (list(task.tools), task.max_turns, task.record_fields) == (
        ["calc"], 4, ("target", "a", "b"))
    assert task.eval_prompts() == [] and task.prompt(0).text == "add 1 2 ="
    with pytest.raises(UserError, match="a dataset's prompts come without solved episodes"):
        task.demonstrations()  # the generator's own are not the dataset's
    alone = build_task(compose_config(f"hydra.searchpath=[file://{TEST_CONF}]", "rewards=trl_style",
                                      f"data.path={data}", "algo=gdpo"))  # a preset of channels alone
    assert isinstance(alone.base, TaskBase) and type(alone.base) is TaskBase and alone.max_turns == 1


def test_demonstrations_are_read_by_declared_signature_not_by_inspect():
    assert "inspect" not in inspect.getsource(mrl.train.demonstrations)
    for function in (mrl.envs.task.build_task, mrl.envs.task.episode_protocol, mrl.envs.task.held_out_prompts,
                     DatasetPrompts):
        source = inspect.getsource(function)
        assert "getattr" not in source and "hasattr" not in source, function
    assert [d.source for d in ToolCallTask().demonstrations("train", 3)] == ["prompt 0", "prompt 1", "prompt 2"]

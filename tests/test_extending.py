"""docs/extending.md's "An environment, or a benchmark", walked through in a copy of the repository: the module, the
preset, its layer in pyproject.toml's `mrl.envs` contract and its line in docs/design.md, and nothing else; then
`make lint` and the layer tests pass there, and `rewards=weather` composes and builds.  Before the two placing lines,
the contract and the layout test each refuse the module, which is why the doc names them.  The slow variant trains
two steps on it with `mrl train`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## An environment, or a benchmark"

MODULE = '''"""weather: is it warm in the prompt's city?  An environment added as docs/extending.md says."""

from __future__ import annotations

from mrl.core.episode import Episode, Prompt
from mrl.envs.task import TaskBase

CITIES = {"paris": True, "oslo": False}


class WeatherTask(TaskBase):
    def __init__(self, seed: int = 0):
        self.seed = seed

    def prompt(self, index: int) -> Prompt:
        city = sorted(CITIES)[(self.seed + index) % len(CITIES)]
        return Prompt(text=f"weather {city} =", meta={"warm": CITIES[city]})


class Correctness:
    """1.0 when the first word answers the prompt: on `weather paris =`, `1` -> 1.0, `0` -> 0.0."""

    def __call__(self, episode: Episode) -> float:
        words = episode.completion.split()
        return float(bool(words) and words[0] == str(int(episode.prompt.meta["warm"])))
'''

PRESET = """# weather: an environment added as docs/extending.md says (tests/test_extending.py).
defaults: [rewards_schema, _self_]
name: weather
pass_channel: correctness
task:
  _target_: mrl.envs.weather.WeatherTask
  seed: ${trainer.seed}
channels:
  correctness:
    fn: {_target_: mrl.envs.weather.Correctness}
    weight: 1.0
"""
DESIGN_LINE = "  3 mrl/envs/weather.py              weather: is it warm in the prompt's city (docs/extending.md)\n"
SINGLE_TURN = '"agent_triple | bfcl | code | humaneval | math_length | tool_call"'


def run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def copy_with_an_environment(tmp_path: Path) -> Path:
    """The repository's code, config, Makefile, design notes and layer tests, copied, with the two files an
    environment is: its module and its preset."""
    repo = tmp_path / "repo"
    for name in ("mrl", "conf", "scripts"):
        shutil.copytree(ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "Makefile", "docs/design.md", "tests/test_layers.py", "tests/test_design_doc.py"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, repo / name)
    (repo / ".venv").symlink_to((ROOT / ".venv").resolve())
    (repo / "mrl" / "envs" / "weather.py").write_text(MODULE)
    (repo / "conf" / "rewards" / "weather.yaml").write_text(PRESET)
    return repo


def place_in_the_house(repo: Path) -> None:
    """The two lines docs/extending.md names: a layer of the mrl.envs contract, and the layout's line."""
    pyproject = repo / "pyproject.toml"
    assert SINGLE_TURN in pyproject.read_text()
    pyproject.write_text(pyproject.read_text().replace(SINGLE_TURN, SINGLE_TURN[:-1] + ' | weather"'))
    design = repo / "docs" / "design.md"
    lines = design.read_text().splitlines(keepends=True)
    after = next(i for i, line in enumerate(lines) if "mrl/envs/tool_call.py" in line)
    design.write_text("".join([*lines[:after + 1], DESIGN_LINE, *lines[after + 1:]]))


def test_the_doc_names_every_file_the_walk_edits():
    section = (ROOT / "docs" / "extending.md").read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    for edited in ("mrl/envs/<name>.py", "conf/rewards/<name>.yaml", "pyproject.toml", "mrl.envs", "docs/design.md",
                   "make lint", "tests/test_extending.py"):
        assert edited in section, f"docs/extending.md's {SECTION[3:]!r} does not name {edited}"


def test_an_environment_added_as_docs_extending_md_says_passes_lint_and_the_layer_tests(tmp_path):
    repo = copy_with_an_environment(tmp_path)
    lint_imports = [str(repo / ".venv" / "bin" / "lint-imports"), "--no-cache"]
    unplaced = run(lint_imports, repo)
    assert unplaced.returncode != 0 and "mrl.envs.weather" in unplaced.stdout, unplaced.stdout[-2000:]
    unlisted = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_design_doc.py"], repo)
    assert unlisted.returncode != 0 and "does not list mrl/envs/weather.py" in unlisted.stdout, unlisted.stdout[-2000:]

    place_in_the_house(repo)
    lint = run(["make", "-s", "-o", ".venv/.installed", "lint"], repo)
    assert lint.returncode == 0 and re.search(r"\d+ kept, 0 broken", lint.stdout), lint.stdout[-3000:] + lint.stderr
    layers = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_layers.py",
                  "tests/test_design_doc.py"], repo)
    assert layers.returncode == 0, layers.stdout[-3000:]
    built = run([sys.executable, "-c", """
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
import mrl.envs.weather
from mrl.core.config import CONF_DIR
from mrl.runs.trust import allowed_targets
assert mrl.envs.weather.__file__.startswith(str(CONF_DIR.parent)), mrl.envs.weather.__file__
with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
    cfg = compose("train", overrides=["rewards=weather"])
task = instantiate(cfg.rewards.task)
print(task.prompt(0).text, "mrl.envs.weather.Correctness" in allowed_targets())
"""], repo)
    assert built.returncode == 0 and built.stdout.split() == ["weather", "oslo", "=", "True"], built.stderr[-2000:]


@pytest.mark.slow
def test_an_environment_added_as_docs_extending_md_says_trains(tmp_path):
    repo = copy_with_an_environment(tmp_path)
    place_in_the_house(repo)
    done = run([sys.executable, "-m", "mrl.cli", "train", "rewards=weather", "trainer.max_steps=2",
                "trainer.prompts_per_step=2", "trainer.group_size=2", "logger=none",
                f"hydra.run.dir={tmp_path / 'run'}"], repo, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").is_file()

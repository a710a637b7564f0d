"""The `mrl` command.  `mrl train ...` hands its arguments, unchanged, to a real @hydra.main function, so
overrides, -m/--multirun, --cfg and --help behave exactly as in any Hydra app (Hydra's compose API has no multirun
and no run dir).

Under a launcher (`torchrun ... -m mrl train`, `deepspeed ... --module mrl train`: mrl/core/distributed.py) the ranks
agree on one run dir before any of them writes: rank 0 runs Hydra as a single process would (its callbacks validate,
lock and check the run dir), then broadcasts the run dir it resolved, `${now:}` included; the other ranks wait for it
and run Hydra with `hydra.run.dir` set to it, without writing `.hydra/` or a log file there.  When rank 0 stops
before that (a bad value, a refused run dir, `--cfg job`), the others exit with its exit code, silently: rank 0 has
said why."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from mrl.core import distributed as dist  # imports no torch: the CLI starts fast
from mrl.core.distributed import exit_with_error, is_main

# A run dir's .hydra/config.yaml names the code that builds its task and rewards (docs/sandbox.md: threat model).
TRUST_HELP = ("Build the run's task and rewards even where its .hydra/config.yaml names a _target_ outside mrl "
              "(code it runs): only for a run dir from a source you trust.")

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Multi-reward RL for LLM agents: PPO, GRPO, DAPO and GDPO in one transparent loop.")


def strip_launcher_args(args: list[str]) -> list[str]:
    """The `deepspeed` launcher passes --local_rank=N to the module (LOCAL_RANK is in the environment too).

    >>> strip_launcher_args(["--local_rank=1", "train", "algo=dapo"])
    ['train', 'algo=dapo']
    """
    return [a for a in args if not a.startswith(("--local_rank=", "--local-rank="))]


def main() -> None:
    """`python -m mrl` (mrl/__main__.py), under a launcher or not.  Under one, every command ends by `dist.finish`
    (os._exit, no C++ teardown at exit); `train` and `sft` there, with their process group, the others here."""
    sys.argv = [sys.argv[0], *strip_launcher_args(sys.argv[1:])]
    with dist.process_group(start=False):
        app(prog_name="mrl")


def hydra_train(config_name: str = "train") -> None:
    """Build and run the @hydra.main entry point of `mrl train` (config_name train) or `mrl sft` (sft); imports are
    deferred so `mrl --help` stays fast."""
    import hydra
    from hydra.core.hydra_config import HydraConfig

    import mrl.core.config  # noqa: F401  registers the schemas
    from mrl.core.config import CONF_DIR, UserError
    from mrl.overrides import check_groups, expand_resume
    from mrl.train.validation import check_yaml_syntax, config_dirs_in

    try:  # Hydra would print a parser's traceback; the values themselves are checked by mrl.train.validation.Preflight
        sys.argv[1:] = expand_resume(sys.argv[1:])  # a resume composes the run's saved overrides
        check_yaml_syntax(config_dirs_in(sys.argv[1:]))
        check_groups(sys.argv[1:], config_dirs_in(sys.argv[1:]))
        if dist.world_size() > 1 and any(a in ("-m", "--multirun") or a.startswith("--multirun=")
                                         for a in sys.argv[1:]):
            raise UserError(f"-m/--multirun under a launcher (WORLD_SIZE={dist.world_size()}) is not supported: "
                            "launch each job of the sweep on its own (one torchrun/deepspeed command per job)")
    except UserError as err:
        exit_with_error(str(err))

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)
    def train_main(cfg) -> None:
        # Start-up time: torch and the trainer load once Hydra has composed the config and Preflight passed it.
        from mrl.rewards.channels import RewardError
        from mrl.runs.checkpoint import CheckpointError
        from mrl.runs.rundir import DISK_FAULTS, Interrupted, disk_fault_message, resume_hint

        if config_name == "sft":  # (each stage's loop imports torch: loaded only once it runs)
            from mrl.train.sft import sft as run
        else:
            from mrl.train.loop import train as run  # (start-up time, as above)
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        try:
            if cfg.stage != config_name.replace("train", "rl"):
                raise UserError(f"stage={cfg.stage}: `mrl {config_name}` runs stage "
                                f"{config_name.replace('train', 'rl')}; leave the stage key as it is")
            run(cfg, run_dir)
        except UserError as err:
            exit_with_error(str(err))
        except RewardError as err:
            exit_with_error(f"{err}\n(run dir: {run_dir})", code=1, every_rank=True)
        except CheckpointError as err:  # a full disk: the previous checkpoint is intact
            exit_with_error(str(err), code=1)
        except OSError as err:  # a full or read-only disk under a write that did not say so itself
            if err.errno not in DISK_FAULTS:
                raise
            exit_with_error(disk_fault_message(err, err.filename or run_dir, "continue with trainer.resume=true"),
                            code=1)
        except Interrupted as err:  # SIGTERM, Ctrl-C: the last completed step is checkpointed
            exit_with_error(f"{err}; {resume_hint(run_dir)}", code=err.exit_code)
        except RuntimeError as err:
            if not dist.peer_lost(err):
                raise
            exit_with_error("another rank stopped (its error is above); this one stops too", code=1, every_rank=True)
        if dist.is_main():
            print(f"mrl: run dir {run_dir}")

    with dist.process_group():  # under a launcher; ended with the command's exit code (dist.finish)
        if dist.world_size() > 1 and not dist.is_main():
            run_dir, code = dist.await_run_dir()
            if code is not None:  # rank 0 stopped before training and said why
                raise SystemExit(code)
            sys.argv += [f"hydra.run.dir='{run_dir}'", "hydra.output_subdir=null", "hydra/job_logging=none"]
        run_hydra(train_main)


def run_hydra(task) -> None:
    """Hydra runs `task` (@hydra.main: the run dir, multirun and the rest); rank 0 tells the other ranks if it
    stopped before announcing a run dir."""
    code = 0
    try:
        task()
    except SystemExit as err:
        code = dist.exit_code_of(err)
        raise
    except BaseException:
        code = 1
        raise
    finally:
        dist.abandon_run_dir(code)  # rank 0 stopped before announcing its run dir: the others exit too


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def train(ctx: typer.Context) -> None:
    """Train. All arguments go to Hydra: overrides (algo=dapo trainer.seed=1), -m, --cfg job, --help; `--resume RUN`
    continues RUN with the overrides it was started with (those that would run code, only with `--trust-config`)."""
    sys.argv = ["mrl train", *ctx.args]
    hydra_train()


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def sft(ctx: typer.Context) -> None:
    """Supervised fine-tuning on the task's demonstrations (or data.path=conversations.jsonl): the warm start for
    `mrl train trainer.init_from=RUN_DIR`.  All arguments go to Hydra, as for train (conf/sft.yaml)."""
    sys.argv = ["mrl sft", *ctx.args]
    hydra_train("sft")


@app.command()
def report(
    run_dirs: List[Path] = typer.Argument(..., help="Run dirs or multirun dirs (searched for metrics.jsonl)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="PNG path (default: report.png in the first dir); "
                                       "the table, the page and its data go beside it."),
    last: int = typer.Option(10, help="Final means are taken over this many last steps."),
    smooth: int = typer.Option(10, help="Moving-average window of the plotted curves (1: raw)."),
    panels: Optional[str] = typer.Option(None, help="Metric keys to draw a panel each for, comma-separated, * as a "
                                         "wildcard (loss/policy,adv/share/*); default: the diagnostics logged."),
) -> None:
    """Plot per-channel reward curves (a panel per channel; per algo its mean over seeds with a band, its runs
    faint) and the diagnostics, and print tables of final means per run and per algo; write the same as an
    interactive page (report.html) with a CSV per run of every metric."""
    from mrl.core.config import UserError
    from mrl.runs.report import ReportError, make_report  # start-up time: `mrl --help` imports none of it

    for flag, value, default in (("--last", last, 10), ("--smooth", smooth, 10)):
        if value < 1:
            exit_with_error(f"{flag} {value}: give a number of steps of at least 1 ({flag} {default} by default; "
                            "--smooth 1 plots the raw curve)")
    try:
        chosen = None if panels is None else [key.strip() for key in panels.split(",") if key.strip()]
        png, table = make_report(run_dirs, out, last, smooth, chosen)
    except (ReportError, UserError) as err:  # UserError: a symlink where the report writes
        exit_with_error(str(err))
    print(table)
    html = png.with_suffix(".html")
    print(f"\nplot: {png}\ntable: {png.with_suffix('.md')}\npage: {html} (open it in a browser; offline is fine)"
          f"\ndata: {html.parent / (html.stem + '_data')}/")


@app.command("eval")
def evaluate(
    args: Optional[List[str]] = typer.Argument(None, help="RUN_DIR (a run dir written by `mrl train`) and key=value "
                                               "overrides of its config, or with --model the config overrides "
                                               "(rewards=tool_call data.path=...)."),
    model: Optional[str] = typer.Option(None, "--model", help="Score this model dir (or builtin:tiny) untrained, "
                                        "on the held-out prompts of conf/train.yaml composed with the overrides."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Where eval.json and eval.jsonl go (default: "
                                       "RUN_DIR, or a new dir under outputs/eval/ with --model)."),
    prompts: int = typer.Option(64, help="Held-out prompts to score."),
    samples: int = typer.Option(4, help="Sampled episodes per prompt, for pass@k (plus one greedy); 0: greedy only."),
    trust_config: bool = typer.Option(False, "--trust-config", help=TRUST_HELP),
) -> None:
    """Score held-out prompts, greedy and sampled: per-channel means, and accuracy and pass@k where
    rewards.pass_channel is set.  `mrl eval RUN_DIR key=value ...`: the run's newest intact checkpoint.
    `mrl eval --model DIR override ...`: a base model, no training."""
    # Start-up time: torch and the models load only for the command that needs them (`mrl --help` stays fast).
    from mrl.core.config import UserError
    from mrl.train.evaluate import EVAL_FILE, EVAL_LINES, evaluate_model, format_table
    from mrl.train.evaluate import evaluate as evaluate_run

    if not is_main():  # under a launcher rank 0 evaluates; the others have nothing to add and exit 0 at once
        return
    args = args or []
    try:
        if model is not None:
            report = evaluate_model(model, args, prompts, samples, out=out)
        elif args and "=" not in args[0]:
            report = evaluate_run(Path(args[0]), prompts, samples, out=out, overrides=args[1:],
                                  trust_config=trust_config)
        else:
            raise UserError(f"{' '.join(['mrl eval', *args])}: give a RUN_DIR (then key=value overrides, if any), or "
                            "--model DIR followed by config overrides (mrl eval --model models/smollm2-135m-instruct "
                            "model=smollm2_local)")
    except UserError as err:
        exit_with_error(str(err))
    print(format_table(report))
    written = Path(report["out"])
    print(f"\njson: {written / EVAL_FILE}\nper prompt: {written / EVAL_LINES}")


@app.command("export")
def export_cmd(
    run_dir: Path = typer.Argument(..., help="A run dir (its latest checkpoint) or a checkpoint dir."),
    merge: bool = typer.Option(False, "--merge", help="LoRA: merge the adapters into the base (a plain HF model)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output dir (default: RUN_DIR/export)."),
    trust_config: bool = typer.Option(False, "--trust-config", help=TRUST_HELP),
) -> None:
    """Write the policy as a model dir: a full fine-tune's as is; a LoRA run's adapters, or with --merge the base
    with the adapters merged, in model.dtype, with the tokenizer (loads with AutoModelForCausalLM.from_pretrained)."""
    # Start-up time: torch and the models load only for the command that needs them (`mrl --help` stays fast).
    from mrl.core.config import UserError
    from mrl.runs.export import export

    try:
        path, what = export(run_dir, out, merge, trust_config)
    except UserError as err:
        exit_with_error(str(err))
    print(f"mrl: wrote {what} to {path}")


if __name__ == "__main__":
    app()

"""scripts/bench.py and scripts/bench_memory.py (`make bench`, `make bench-memory`): what they build composes and
matches on both sides, so that the benchmarks cannot rot.  Nothing is timed here; TRL's side is checked where the
`bench` extra is installed."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bench = load("bench")
bench_memory = load("bench_memory")
SHAPES = {**bench.SHAPES, "memory": bench_memory.shape_for(Path("/nonexistent/bench-qwen2"))}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_mrl_side_composes_as_the_shape_says(name):
    shape = SHAPES[name]
    cfg = bench.mrl_config(shape, 4)
    t = cfg.trainer
    assert (t.prompts_per_step, t.group_size, t.max_new_tokens, t.max_steps) == (shape.prompts, shape.group,
                                                                                  shape.tokens, 4)
    assert t.micro_batch_size == shape.prompts * shape.group and t.num_mini_batches == 1 and t.lr == shape.lr
    assert (cfg.algo.name, cfg.algo.epochs, cfg.algo.kl_coef, cfg.algo.loss_agg) == ("grpo", 1, 0.0, "seq_mean")
    assert list(cfg.rewards.channels) == ["correctness"] and cfg.logger.backend == "none"
    assert cfg.rollout.engine == "auto" and bench.mrl_config(shape, 4, engine="hf").rollout.engine == "hf"


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_trl_side_trains_the_same_batch(name, tmp_path):
    pytest.importorskip("trl")
    from trl import GRPOConfig

    shape = SHAPES[name]
    args = GRPOConfig(**bench.trl_args(shape, 4, str(tmp_path)))
    assert args.per_device_train_batch_size == args.generation_batch_size == shape.prompts * shape.group
    assert (args.num_generations, args.max_completion_length, args.max_steps) == (shape.group, shape.tokens, 4)
    assert args.steps_per_generation == args.num_iterations == args.gradient_accumulation_steps == 1
    assert args.beta == 0 and args.loss_type == "grpo" and args.learning_rate == shape.lr and args.use_cpu
    assert (args.temperature, args.top_p, args.top_k) == (1.0, 1.0, 0) and not args.use_vllm


def test_both_score_with_mrls_own_channel():
    cfg = bench.mrl_config(bench.SHAPES["tiny"], 2)
    rows = bench.shared_prompts(cfg, 2, chat=False)
    assert [r["prompt"] for r in rows] == ["max 8 4 =", "max 0 5 ="]  # math_length's first prompts, as mrl's
    reward = bench.trl_reward(cfg)
    answer = [json.loads(r["meta"])["answer"] for r in rows]
    columns = {k: [r[k] for r in rows] for k in ("meta", "text", "messages")}
    # plain text (tiny model) and chat messages (SmolLM2): the last number is the answer
    text = reward(prompts=None, completions=[f"w3 {answer[0]}", "w3"], completion_ids=[[5, 6], [5]], **columns)
    chat = reward(prompts=None, completions=[[{"role": "assistant", "content": f"so {a}"}] for a in answer],
                  completion_ids=[[5, 6], [5, 6]], **columns)
    assert text == [1.0, 0.0] and chat == [1.0, 1.0]


def test_the_memory_model_is_a_tied_qwen2_of_98m_parameters(monkeypatch):
    """Built at a small vocabulary (fast); at Qwen's 151,936 the embedding adds the rest: ~9.8M parameters."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(bench_memory, "VOCAB", 96)
    directory = bench_memory.model_dir()
    model = AutoModelForCausalLM.from_pretrained(directory)
    config = model.config
    assert config.model_type == "qwen2" and config.tie_word_embeddings and config.vocab_size == 96
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    at_qwen_vocab = sum(p.numel() for p in model.parameters()) + (151936 - 96) * config.hidden_size
    assert math.isclose(at_qwen_vocab / 1e6, 9.85, abs_tol=0.05)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert len(tokenizer) == 96 and tokenizer.decode([95]).strip()  # every id is a word: any sample decodes


def test_dry_run_lists_both_sides(capsys):
    pytest.importorskip("trl")
    bench.main(["--dry-run", "--shapes", "tiny,smollm2"])
    out = capsys.readouterr().out
    assert "tiny: mrl grpo P=8 G=8 T=10" in out and "TRL batch=8 G=4 T=32" in out


def test_the_output_layer_bench_runs_each_way_on_the_same_numbers():
    """scripts/bench_head.py at a small width: mrl's two ways agree on the loss and both gradients (the script exits
    on a disagreement; Liger's way is compared where it is installed)."""
    bench_head = load("bench_head")
    ways = ["checkpointed", "linear"] + (["liger"] if importlib.util.find_spec("liger_kernel") else [])
    runs = [bench_head.one(way, hidden_size=8, rows=2, tokens=4, steps=1) for way in ways]
    for run in runs[1:]:
        for key in ("loss", "grad_hidden", "grad_weight"):
            assert run[key] == pytest.approx(runs[0][key], rel=1e-5, abs=1e-7), (run["way"], key)
    assert runs[0]["grad_weight"] > 0


def test_the_output_layer_bench_reports_the_peak_its_steps_added(monkeypatch):
    """peak_mb: the process's peak resident set (ru_maxrss, KiB) after the steps less before them, in MiB."""
    import resource

    bench_head = load("bench_head")
    peaks = iter([100 * 1024, 612 * 1024])  # KiB before and after the steps
    monkeypatch.setattr(resource, "getrusage", lambda who: type("Usage", (), {"ru_maxrss": next(peaks)}))
    assert bench_head.one("linear", hidden_size=8, rows=2, tokens=4, steps=1)["peak_mb"] == 512


def test_both_trainers_are_pinned_to_the_same_last_cores():
    import os

    mine = sorted(os.sched_getaffinity(0))
    assert bench.worker_cores(1) == {mine[-1]}
    assert bench.worker_cores(len(mine) + 5) == set(mine)


def test_the_base_arm_imports_an_earlier_checkouts_flat_names(tmp_path, monkeypatch):
    """bench_step's base arm runs a checkout from before the packages by layer (8b63511: mrl/loop.py, no
    mrl/train/): the scripts then import each module by its flat name."""
    import importlib

    import mrl

    bench = load("bench")
    assert bench.own_module("mrl.train.loop").__name__ == "mrl.train.loop"
    imported = []
    monkeypatch.setattr(mrl, "__file__", str(tmp_path / "mrl" / "__init__.py"))  # a checkout without mrl/train/
    monkeypatch.setattr(importlib, "import_module", lambda name: imported.append(name))
    bench.own_module("mrl.train.loop")
    bench.own_module("mrl.core.config")
    assert imported == ["mrl.loop", "mrl.config"]


# ---- bench_rollout (make bench-rollout) --------------------------------------------------------------------------

def test_bench_rollouts_middle_shape_is_bench_steps_rollout():
    bench_rollout = load("bench_rollout")
    bench_step = sys.modules["bench_step"]
    assert bench_rollout.SHAPES[24] == (bench_step.P, bench_step.G)
    assert all(p * g == rows for rows, (p, g) in bench_rollout.SHAPES.items())
    assert {engine for engine, _ in bench_rollout.ARMS.values()} == {"native", "vllm"}


def test_bench_rollouts_table_reads_each_arms_numbers():
    bench_rollout = load("bench_rollout")
    row = {"arm": "vllm16", "rows": 24, "start_s": 33.96, "seconds": 3.204, "tokens_per_s": 411.6, "mean_length": 55.04}
    assert bench_rollout.table([row]).splitlines()[-1] == "| vllm16 | vllm | bfloat16 | 24 | 3.20 | 412 | 55.0 | 34.0 |"


@pytest.mark.parametrize("argv", [["--rows", "12"], ["--arms", "trl"], ["--repeats", "0"]])
def test_bench_rollout_refuses_a_shape_or_arm_it_has_not_in_one_line(argv):
    bench_rollout = load("bench_rollout")
    with pytest.raises(SystemExit, match="bench_rollout: .* not among --rows 8,24,64"):
        bench_rollout.main(argv)


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "models" / "smollm2-135m-instruct" / "config.json").exists(),
                    reason="run `make smollm2` first")
def test_bench_rollouts_native_arm_times_a_rollout(capsys):
    bench_rollout = load("bench_rollout")
    bench_rollout.worker("native32", [8], 1, 1, ROOT / "models" / "smollm2-135m-instruct")
    report = json.loads(capsys.readouterr().out.splitlines()[-1][len(bench.PREFIX):])
    assert report["arm"] == "native32" and report["rows"] == 8 and 0 < report["mean_length"] <= 64
    assert report["seconds"] > 0 and report["tokens_per_s"] == pytest.approx(report["mean_length"] * 8
                                                                              / report["seconds"], rel=1e-6)

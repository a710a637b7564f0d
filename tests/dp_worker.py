"""Run by tests/test_distributed.py under `torchrun`: the real `python -m mrl` entry point, with two probes.

`python tests/dp_worker.py train ...` is `python -m mrl train ...` (mrl.cli.main), except that after each checkpoint
every rank writes its whole parameters (gathered under ZeRO-3) to RUN_DIR/params_rank<r>_step<k>.pt, so the test
can compare the ranks' weights (and its run state, state_rank<r>_step<k>.json: the constraints'
prices); and `grads ...` runs one update on a fixed batch (see `grads`).
With MRL_TEST_FULL_DISK_ON_RANK0=1 rank 0's writes of the policy dir fail as on a full disk (the other ranks'
DeepSpeed writes go on); `dp_worker.AlwaysFails` is a reward channel that fails on every sample,
`dp_worker.FailsOnRank1` one that fails on rank 1 alone.
"""

from __future__ import annotations

import json
import os
import sys


def spy_on_checkpoints() -> None:
    import torch

    import mrl.train.loop as loop

    original = loop.save_checkpoint

    def save_and_dump(run_dir, step, state, actor, tokenizer, critic=None, identity=None):
        final = original(run_dir, step, state, actor, tokenizer, critic, identity)
        with actor.whole():
            params = {k: v.detach().clone().float() for k, v in actor.module.state_dict().items()}
        torch.save(params, run_dir / f"params_rank{os.environ.get('RANK', '0')}_step{step}.pt")
        (run_dir / f"state_rank{os.environ.get('RANK', '0')}_step{step}.json").write_text(json.dumps(state))
        return final

    loop.save_checkpoint = save_and_dump


class AlwaysFails:
    def __call__(self, episode) -> float:
        raise RuntimeError("grader unreachable")


class FailsOnRank1:
    """Fails on rank 1 only: that rank stops alone, its peer waits in the step's next collective."""

    def __call__(self, episode) -> float:
        if os.environ.get("RANK") == "1":
            raise RuntimeError("grader unreachable on rank 1")
        return 0.0


def full_disk_on_rank0() -> None:
    import errno

    import mrl.runs.checkpoint as checkpoint

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if os.environ.get("RANK") == "0":
        checkpoint.save_model_dir = checkpoint.save_adapter = no_space


def grads(out: str, stage: int) -> None:
    """One update of the tiny policy on a fixed batch of 8 rollouts (identical on every rank: same seed, prompts and
    weights), split unevenly over the ranks (5 rows and 3 on two), for both loss aggregations.  Writes what the
    update returns (grad_norm is DeepSpeed's norm of the gradient averaged over ranks) and a digest of the weights
    after the step, so that 1 and 2 ranks can be compared."""
    import torch
    from hydra import compose, initialize_config_dir

    import mrl.core.config  # noqa: F401
    from mrl.algo.advantages import ESTIMATORS
    from mrl.core import distributed as dist
    from mrl.core.config import CONF_DIR
    from mrl.envs.task import build_task, episode_protocol
    from mrl.generation.rollout import InProcessEngine, Sampling
    from mrl.rewards.channels import build_reward_set
    from mrl.train.batch import StepBatch, lockstep
    from mrl.train.collect import CollectSettings, collect
    from mrl.train.loop import build_models, seed_everything
    from mrl.train.update import AlgoSettings, update

    results = {}
    for agg in ("token_mean", "seq_mean"):
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=[
                f"deepspeed=zero{stage}", "trainer.device=cpu", "logger=none", "algo=grpo", f"algo.loss_agg={agg}",
                "trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.micro_batch_size=2", "trainer.lr=1e-2"])
        seed_everything(0)
        device = torch.device("cpu")
        estimator = ESTIMATORS[cfg.algo.advantage]
        tokenizer, actor, _, _ = build_models(cfg, estimator, device)
        reward_set = build_reward_set(cfg.rewards, cfg.algo)
        world = dist.world_size()
        # The same 8 rollouts on every rank: generate as one process would (rank 0 of 1: all prompts), same seed.
        rank = os.environ["RANK"]
        os.environ.update(WORLD_SIZE="1", RANK="0")
        seed_everything(1)
        engine = InProcessEngine(actor.module.policy, tokenizer, device)
        task = build_task(cfg)
        sampling = Sampling.of(cfg.trainer)
        settings = CollectSettings.of(cfg, sampling, episode_protocol(cfg, tokenizer, task), estimator)
        full = collect(settings, task, engine, actor.whole, tokenizer, reward_set, {"step": 0, "prompt_position": 0})
        os.environ.update(WORLD_SIZE=str(world), RANK=rank)
        batch = full.rollouts
        generator = torch.Generator().manual_seed(2)
        advantages = torch.randn(8, 1, generator=generator) * batch.completion_mask.float()  # [8, T]
        rows = {1: [list(range(8))], 2: [[0, 1, 2, 3, 4], [5, 6, 7]]}[world][dist.rank()]
        mine = batch.take(torch.tensor(rows))
        local = lockstep(StepBatch(mine), tokenizer.pad_token_id).rollouts
        mask = local.completion_mask.float()
        keep = dist.pad_to(torch.ones(len(rows)), (mask.shape[0],))
        adv = dist.pad_to(advantages[rows][:, :mine.completion_ids.shape[1]], mask.shape)
        torch.manual_seed(3)  # the mini-batch permutation
        sums, _ = update(AlgoSettings.of(cfg, sampling), actor, None, StepBatch(local, loss_mask=mask * keep[:, None],
                                                                                 advantages=adv))
        sums = dist.mean_over_ranks(sums)
        with actor.whole():
            weights = {k: v.detach().float() for k, v in actor.module.state_dict().items()}
        results[agg] = {"grad_norm": sums["grad_norm"], "loss": sums["loss/policy"],
                        "weight_sum": sum(float(v.double().sum()) for v in weights.values()),
                        "weight_abs": sum(float(v.double().abs().sum()) for v in weights.values())}
    if dist.is_main():
        with open(out, "w") as file:
            json.dump(results, file)


if __name__ == "__main__":
    if sys.argv[1] == "grads":
        from mrl.core import distributed

        distributed.init()
        grads(sys.argv[2], int(sys.argv[3]))
    else:
        spy_on_checkpoints()
        if os.environ.get("MRL_TEST_FULL_DISK_ON_RANK0"):
            full_disk_on_rank0()
        from mrl.cli import main

        main()

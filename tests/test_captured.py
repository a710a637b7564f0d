"""mrl's captured decoder (mrl/generation/captured.py), on CPU, where its step runs eagerly over the same static buffers
a CUDA graph replays: greedy it picks HF generate's tokens, sampled with HF's draw (`multinomial`) and the same seed it
draws HF's very tokens (each family, a cached prompt, left padding, warpers, a stop criterion, the multi-turn tool loop,
LoRA); buckets are kept across calls and across in-place weight updates, dropped when a weight moves; the first-use
check refuses (`captured`) or falls back (`auto` on CUDA) in one line."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from conftest import scale_logits
from test_decoder import PAD, STOP, TENSORS, draw, family_model, grouped_batch

import mrl.generation.captured as captured
from mrl.chat.protocols import Tool, WordsProtocol
from mrl.core.config import UserError
from mrl.core.episode import Prompt
from mrl.generation.decoder import DecodeRequest, multinomial
from mrl.generation.rollout import (
    ROLLOUT_ENGINES,
    Sampling,
    auto_cuda_decode,
    auto_decode,
    captured_decode,
    generate,
    hf_decode,
    hf_greedy,
    native_decode,
)

CPU = torch.device("cpu")
captured_hf_draw = partial(captured_decode, draw=multinomial)  # the captured decoder drawing as HF generate draws
SAMPLED = Sampling(12, temperature=0.8, top_k=30, top_p=0.95)
GREEDY = Sampling(12, greedy=True)


def test_bucket_shapes_round_rows_to_powers_of_two_and_keys_to_the_quantum():
    assert captured.bucket_shape(12, 130) == (16, 256)
    assert captured.bucket_shape(1, 1) == (8, 128)  # ROWS_MIN, LENGTH_QUANTUM
    assert captured.bucket_shape(64, 128) == (64, 128)
    assert captured.bucket_shape(65, 129) == (128, 256)


@pytest.mark.parametrize("kind, cached", [("llama", 0), ("qwen2", 5), ("qwen3", 5), ("mistral", 0)])
def test_captured_decode_draws_the_tokens_hf_generate_draws(kind, cached):
    """12 rows (a bucket of 16: 4 padding rows), 6 prompts sharing a cache, 3 left-padded: the same tokens row for
    row, greedy and sampled (temperature, top-k, top-p), and rows that stop early are padded as HF pads them."""
    model = family_model(kind)
    for sampling in (GREEDY, SAMPLED):
        hf = draw(hf_decode, model, sampling, cached=cached)
        assert torch.equal(draw(captured_hf_draw, model, sampling, cached=cached), hf), sampling
    assert captured.ROWS_MIN <= 16 and captured.captured_decoder(model).buckets.keys() == {(16, 128)}
    assert sum(STOP in row[:-1] for row in hf[:, grouped_batch()[0].shape[1]:].tolist()) > 0
    if kind == "llama":  # the native decoder's own draw on a CPU (inverse_cdf): its tokens
        own = draw(captured_decode, model, SAMPLED, cached=cached)
        assert torch.equal(own, draw(native_decode, model, SAMPLED, cached=cached)) and not own.is_inference()


def test_one_token_and_a_stop_criterion():
    """budget 1 is the prompt's step alone; a stopping criterion ends a row at that token, as in HF generate."""
    model = family_model("llama")
    ids, mask, _ = grouped_batch()
    stop_at_seven = lambda ids, scores: ids[:, -1] == 7  # noqa: E731
    for budget in (1, 12):
        outs = []
        for decode in (hf_decode, captured_hf_draw):
            torch.manual_seed(0)
            request = DecodeRequest(ids, mask, budget, [STOP], PAD, criteria=stop_at_seven)
            outs.append(decode(model, request, Sampling(budget)))
        assert torch.equal(outs[0], outs[1]) and outs[1].shape[1] <= ids.shape[1] + budget
    new = outs[1][:, ids.shape[1]:].tolist()
    stopped = [row for row in new if 7 in row and row.index(7) < len(row) - 1]
    assert stopped and all(set(row[row.index(7) + 1:]) == {PAD} for row in stopped)


def test_the_turn_loop_samples_the_same_rollouts_through_the_captured_engine(model, tokenizer):
    """generate() with tool results appended between turns (each turn a new call, fewer rows): HF's rollouts."""
    tools = {"calc": Tool("calc", fn=lambda prompt, arguments: "| |")}
    protocol = WordsProtocol(tokenizer, tools, tuple(str(d) for d in range(10)), 3)
    prompts = [Prompt("add 3 4 ="), Prompt("7"), Prompt("max 2 9 =")]
    sampling = Sampling(10, temperature=0.9, top_k=20)
    torch.manual_seed(0)
    hf = generate(model, tokenizer, prompts, 4, sampling, protocol, CPU, hf_decode)
    torch.manual_seed(0)
    through = generate(model, tokenizer, prompts, 4, sampling, protocol, CPU, captured_hf_draw)
    assert sum(len(e.tool_calls) for e in hf.episodes) > 0  # later turns were generated too
    for name in TENSORS:
        assert torch.equal(getattr(hf, name), getattr(through, name)), name
    assert through.episodes == hf.episodes
    engine = ROLLOUT_ENGINES["captured"](None, model, tokenizer, CPU)
    assert engine.decode is captured_decode
    engine.generate(prompts, 4, sampling, protocol)  # the engine's own draw: it runs


def test_buckets_survive_in_place_updates_and_are_dropped_when_a_weight_moves(monkeypatch):
    """A bucket is made once per shape and reused (rows 12 and 9 share the bucket of 16); an optimizer step updates
    the weights in place: the same bucket decodes the new weights (HF's tokens on them); a weight given new storage
    drops every bucket; past MAX_BUCKETS the oldest goes."""
    model = family_model("qwen3")
    decoder = captured.captured_decoder(model)
    draw(captured_decode, model, GREEDY)
    bucket = decoder.buckets[(16, 128)]
    ids, mask, _ = grouped_batch(groups=3, group_size=3)  # 9 rows
    captured_decode(model, DecodeRequest(ids, mask, 4, [STOP], PAD), GREEDY)
    assert list(decoder.buckets.values()) == [bucket]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(input_ids=ids).logits.logsumexp(-1).mean().backward()
    optimizer.step()
    before = draw(hf_decode, family_model("qwen3"), GREEDY)
    after = draw(hf_decode, model, GREEDY)
    assert not torch.equal(before, after)  # the step changed the tokens
    assert torch.equal(draw(captured_decode, model, GREEDY), after) and decoder.buckets[(16, 128)] is bucket
    with torch.no_grad():
        model.model.norm.weight.data = model.model.norm.weight.data.clone()  # new storage: the graph's is stale
    assert torch.equal(draw(captured_decode, model, GREEDY), after) and decoder.buckets[(16, 128)] is not bucket
    monkeypatch.setattr(captured, "MAX_BUCKETS", 2)
    for length in (1, 130, 260):
        decoder.bucket(3, length)
    assert list(decoder.buckets) == [(8, 256), (8, 384)]
    # KV buffers: 2 layers x (keys, values) x 8 rows x 2 heads x 384 keys x 16 dims x 4 bytes, within the bound
    assert decoder.buckets[(8, 384)].kv_bytes == 2 * 2 * 8 * 2 * 384 * 16 * 4 == decoder.kv_bound(8, 384)
    monkeypatch.setattr(captured, "kv_limit", lambda device: decoder.kv_bound(8, 512) + 1)  # room for one
    decoder.bucket(3, 500)
    assert list(decoder.buckets) == [(8, 512)]


def test_adapters_act_in_the_captured_decoder_and_their_updates_reach_it():
    """LoRA is decoded unmerged, as the model computes it: HF generate's tokens on the adapted model, greedy and
    sampled; an in-place change of lora_B changes the tokens with the same bucket."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(family_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(3)
    lora_b = [param for name, param in peft_model.named_parameters() if "lora_B" in name]
    with torch.no_grad():
        for param in lora_b:
            param.normal_(0, 0.5)  # adapters that change the model (lora_B starts at zero)
    peft_model.eval()
    for sampling in (GREEDY, Sampling(12)):
        tokens = draw(captured_hf_draw, peft_model, sampling, cached=3)
        assert torch.equal(tokens, draw(hf_decode, peft_model.get_base_model(), sampling, cached=3))
    bucket = captured.captured_decoder(peft_model).buckets[(16, 128)]
    with torch.no_grad():
        for param in lora_b:
            param.mul_(-1)
    flipped = draw(captured_decode, peft_model, GREEDY)
    assert torch.equal(flipped, draw(hf_decode, peft_model.get_base_model(), GREEDY))
    assert not torch.equal(flipped, draw(captured_decode, family_model("llama"), GREEDY))
    assert captured.captured_decoder(peft_model).buckets[(16, 128)] is bucket


def test_a_model_whose_tokens_differ_is_refused_by_captured_and_left_to_hf_by_auto_on_cuda(capsys):
    """The first-use check compares greedy tokens with HF generate's: a forward that negates its logits (the
    captured decoder calls the layers, not the forward) picks other tokens.  `captured` refuses in one line; `auto`
    on CUDA says once that HF generate decodes, and does; where the check passes, it says the captured one does."""
    model = family_model("llama")
    assert captured.first_use_check(model, hf_greedy) is None
    odd = family_model("llama")
    scale_logits(odd, -1.0)
    with pytest.raises(UserError, match=r"rollout.engine=captured: model type 'llama': the captured decoder's greedy "
                                        r"tokens equal HF generate's on \d+ of 16 rows.* rollout.engine=hf"):
        draw(captured_decode, odd, GREEDY)
    sampling = Sampling(12, temperature=0.9)
    assert torch.equal(draw(auto_cuda_decode, odd, sampling), draw(hf_decode, odd, sampling))
    assert torch.equal(draw(auto_cuda_decode, model, sampling), draw(captured_decode, model, sampling))
    draw(auto_cuda_decode, odd, sampling)
    told = capsys.readouterr().err
    assert told.count("rollout.engine=auto: HF generate decodes (model type 'llama'") == 1
    assert told.count("rollout.engine=auto: the captured decoder decodes (CUDA graphs") == 1
    gemma = family_model("gemma")
    assert torch.equal(draw(auto_cuda_decode, gemma, sampling), draw(hf_decode, gemma, sampling))
    assert "HF generate decodes (model_type 'gemma'" in capsys.readouterr().err


def test_auto_picks_captured_on_cuda_and_keeps_the_native_decoder_elsewhere(model, tokenizer):
    assert ROLLOUT_ENGINES["auto"](None, model, tokenizer, torch.device("cuda")).decode is auto_cuda_decode
    assert ROLLOUT_ENGINES["auto"](None, model, tokenizer, CPU).decode is auto_decode
    with pytest.raises(UserError, match=r"rollout.engine=captured: .*'gemma'.* use rollout.engine=auto or hf"):
        ROLLOUT_ENGINES["captured"](None, family_model("gemma"), tokenizer, CPU)


def test_a_short_run_trains_with_the_captured_engine(make_cfg, tmp_path):
    from mrl.train.loop import train

    final = train(make_cfg("algo=grpo", "rollout.engine=captured", "trainer.max_steps=1"), tmp_path)
    assert final["loss/policy"] is not None and final["perf/tokens_per_s"] > 0


def test_the_decoder_lives_and_dies_with_its_model():
    """Kept on the model (its buckets for the next call), freed with it; a deep copy of the model gets its own."""
    import copy
    import gc
    import weakref

    model = family_model("llama")
    draw(captured_decode, model, GREEDY, budget=2)
    decoder = captured.captured_decoder(model)
    assert captured.captured_decoder(model) is decoder and decoder.buckets
    twin = copy.deepcopy(model)
    assert captured.captured_decoder(twin) is not decoder
    freed = weakref.ref(decoder)
    del model, decoder, twin
    gc.collect()
    assert freed() is None

"""mrl's native decoder (mrl/decoder.py): with the same seed it draws exactly the tokens HF `generate` draws, for
every family it claims, through the whole turn loop, with adapters and under autocast; and what it cannot run is
refused by name or left to HF `generate`."""

from __future__ import annotations

import pytest
import torch
from conftest import scale_logits

from mrl.config import UserError
from mrl.decoder import NativeDecoder, unsupported
from mrl.episode import Prompt
from mrl.models import empty_cache
from mrl.protocols import Tool, WordsProtocol
from mrl.rollout import ROLLOUT_ENGINES, Sampling, generate, hf_decode, native_decode, position_ids

CPU = torch.device("cpu")
PAD, STOP = 0, 1
TENSORS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "completion_attention")


def family_model(kind: str, **extra):
    """A random-init 2-layer model of family `kind` with a 40-token vocabulary."""
    import transformers

    configs = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig,
               "gemma": transformers.GemmaConfig}
    models = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
              "qwen3": transformers.Qwen3ForCausalLM, "mistral": transformers.MistralForCausalLM,
              "gemma": transformers.GemmaForCausalLM}
    settings = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=PAD,
                    eos_token_id=STOP)
    if kind == "mistral":
        settings["sliding_window"] = None
    settings.update(extra)
    torch.manual_seed(0)
    return models[kind](configs[kind](**settings)).eval()


def left_padded_batch(rows: int = 12, width: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, width] random ids, the first rows left-padded by 1..3 positions."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 40, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((3, 2, 1)):
        ids[row, :pad], mask[row, :pad] = PAD, 0
    return ids, mask


def draw(decode, model, ids, mask, sampling: Sampling, budget: int = 12, cached: int = 0, seed: int = 0):
    """`decode`'s tokens for a batch, its first `cached` positions given as a KV cache (as `generate` gives the
    shared prompt's)."""
    cache = None
    if cached:
        cache = empty_cache(model)
        with torch.no_grad():
            model(input_ids=ids[:, :cached], attention_mask=mask[:, :cached],
                  position_ids=position_ids(mask[:, :cached]), use_cache=True, cache=cache)
    torch.manual_seed(seed)
    return decode(model, ids, mask, cache, sampling, budget, [STOP], PAD, None)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("cached", [0, 5])
def test_native_decode_draws_the_tokens_hf_generate_draws(kind, cached):
    """Same seed, same tokens, row for row: left padding, a cached prefix, temperature, top-k and top-p; and rows
    that stop early are padded as HF pads them.  A differing draw would show at the first differing logit."""
    model = family_model(kind)
    ids, mask = left_padded_batch()
    sampling = Sampling(12, temperature=0.8, top_k=30, top_p=0.95)
    hf = draw(hf_decode, model, ids, mask, sampling, cached=cached)
    native = draw(native_decode, model, ids, mask, sampling, cached=cached)
    assert torch.equal(native, hf)
    new = hf[:, ids.shape[1]:]
    assert (new == STOP).any() and (new == PAD).any()  # some rows ended early: the padding after them was compared
    assert not torch.equal(draw(native_decode, model, ids, mask, sampling, seed=1), native)  # the draw is random


def test_greedy_native_decode_is_hf_greedy():
    model = family_model("qwen3")
    ids, mask = left_padded_batch()
    sampling = Sampling(12, greedy=True)
    assert torch.equal(draw(native_decode, model, ids, mask, sampling, cached=4),
                       draw(hf_decode, model, ids, mask, sampling, cached=4))


def test_native_decode_stops_where_a_criterion_says():
    """A stopping criterion (the protocol's stop strings) ends a row at that token, as in HF generate."""
    model = family_model("llama")
    ids, mask = left_padded_batch()
    stop_at_seven = lambda ids, scores: ids[:, -1] == 7  # noqa: E731
    outs = []
    for decode in (hf_decode, native_decode):
        torch.manual_seed(0)
        outs.append(decode(model, ids, mask, None, Sampling(12), 12, [STOP], PAD, stop_at_seven))
    assert torch.equal(outs[0], outs[1])
    new = outs[1][:, ids.shape[1]:].tolist()
    stopped = [row for row in new if 7 in row and row.index(7) < len(row) - 1]
    assert stopped and all(set(row[row.index(7) + 1:]) == {PAD} for row in stopped)


def test_the_turn_loop_samples_the_same_rollouts_with_either_decoder(model, tokenizer):
    """Through generate(): several turns with tool results, each prompt's cache shared by its group."""
    tools = {"calc": Tool("calc", fn=lambda prompt, arguments: "| |")}
    protocol = WordsProtocol(tokenizer, tools, tuple(str(d) for d in range(10)), 3)
    prompts = [Prompt("add 3 4 ="), Prompt("7"), Prompt("max 2 9 =")]
    sampling = Sampling(10, temperature=0.9, top_k=20)
    runs = []
    for decode in (hf_decode, native_decode):
        torch.manual_seed(0)
        runs.append(generate(model, tokenizer, prompts, 4, sampling, protocol, CPU, decode))
    assert sum(len(e.tool_calls) for e in runs[0].episodes) > 0  # later turns were generated too
    for name in TENSORS:
        assert torch.equal(getattr(runs[0], name), getattr(runs[1], name)), name
    assert runs[0].episodes == runs[1].episodes


def test_adapters_act_in_native_decode():
    """Under LoRA the native decoder calls the adapted projections: its tokens are HF generate's on the adapted
    model, and differ from the base model's."""
    from peft import LoraConfig, get_peft_model

    base_tokens = draw(native_decode, family_model("llama"), *left_padded_batch(), Sampling(12, greedy=True))
    peft_model = get_peft_model(family_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(3)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.5)  # adapters that change the model (lora_B starts at zero)
    peft_model.eval()
    ids, mask = left_padded_batch()
    for sampling in (Sampling(12, greedy=True), Sampling(12)):
        native = draw(native_decode, peft_model, ids, mask, sampling, cached=3)
        assert torch.equal(native, draw(hf_decode, peft_model.get_base_model(), ids, mask, sampling, cached=3))
    assert not torch.equal(draw(native_decode, peft_model, ids, mask, Sampling(12, greedy=True)), base_tokens)


def test_native_decode_computes_under_the_models_autocast():
    """A model wrapped by mrl.precision.compute_in (bf16 autocast) decodes under that autocast: its projections
    compute in bf16, and its greedy tokens are HF generate's under the same autocast."""
    from mrl.precision import Precision, compute_in

    model = compute_in(family_model("llama"), Precision(compute=torch.bfloat16, export=torch.bfloat16), CPU)
    ids, mask = left_padded_batch()
    sampling = Sampling(12, greedy=True)
    assert torch.equal(draw(native_decode, model, ids, mask, sampling), draw(hf_decode, model, ids, mask, sampling))
    computed = []
    hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, out: computed.append(out.dtype))
    draw(native_decode, model, ids, mask, sampling, budget=2)
    hook.remove()
    assert computed == [torch.bfloat16] * 2


def test_what_the_native_decoder_cannot_run_is_named_and_left_to_hf(model, tokenizer):
    gemma = family_model("gemma")
    assert "model_type 'gemma'" in unsupported(gemma)
    sliding = family_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert "sliding-window" in unsupported(sliding)
    assert "sliding-window" in unsupported(family_model("mistral", sliding_window=4))
    assert unsupported(model) is None and unsupported(family_model("qwen2")) is None
    with pytest.raises(ValueError, match="gemma"):
        NativeDecoder(gemma)
    with pytest.raises(UserError, match=r"rollout.engine=native: .*'gemma'.* use rollout.engine=auto or hf"):
        ROLLOUT_ENGINES["native"](None, gemma, tokenizer, CPU)
    assert ROLLOUT_ENGINES["auto"](None, gemma, tokenizer, CPU).decode is hf_decode
    assert ROLLOUT_ENGINES["auto"](None, model, tokenizer, CPU).decode is native_decode
    assert ROLLOUT_ENGINES["hf"](None, model, tokenizer, CPU).decode is hf_decode


def test_a_model_whose_forward_differs_is_refused_at_first_use():
    """A variant that passes the structural checks but computes other logits (here: a forward that scales them)
    is refused in one line when the native decoder first meets it; a model class of a checkpoint's own code is not
    taken at all."""
    model = family_model("llama")
    scale_logits(model, 2.0)
    ids, mask = left_padded_batch()
    with pytest.raises(UserError, match=r"model type 'llama': .*native decoder.* rollout.engine=hf"):
        draw(native_decode, model, ids, mask, Sampling(4))

    from transformers import LlamaForCausalLM

    class RemoteLlama(LlamaForCausalLM):  # what trust_remote_code would load: the checkpoint's own class
        pass

    assert "RemoteLlama is the checkpoint's own code" in unsupported(RemoteLlama(family_model("llama").config))

"""mrl's native decoder (mrl/generation/decoder.py): given HF's draw (`multinomial`) and the same seed it draws exactly
the tokens HF `generate` draws, for every family it claims, through the whole turn loop, with adapters and under
autocast; its own draw (`inverse_cdf`) samples the same distribution; and what it cannot run is refused by name or left
to HF `generate`."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from conftest import scale_logits

from mrl.chat.protocols import Tool, WordsProtocol
from mrl.core.config import UserError
from mrl.core.episode import Prompt
from mrl.generation.decoder import (
    DecodeRequest,
    NativeDecoder,
    inverse_cdf,
    multinomial,
    pack,
    packable_linears,
    packed_linear,
    unsupported,
)
from mrl.generation.rollout import (
    ROLLOUT_ENGINES,
    Sampling,
    auto_decode,
    generate,
    hf_decode,
    native_decode,
    prompt_cache,
)

CPU = torch.device("cpu")
PAD, STOP = 0, 1
native_hf_draw = partial(native_decode, draw=multinomial)  # the native decoder drawing as HF generate draws
TENSORS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "completion_attention")


def family_model(kind: str, **extra):
    """A random-init 2-layer model of family `kind` with a 40-token vocabulary (head_dim 16, not hidden / heads)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=PAD,
                    eos_token_id=STOP)
    if kind == "mistral":
        settings["sliding_window"] = None
    settings.update(extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **settings)).eval()


def grouped_batch(groups: int = 6, group_size: int = 2, width: int = 7, suffix: int = 2):
    """Rows as the turn loop builds them: `groups` distinct prompts of `width` (the first three left-padded by 3, 2
    and 1), each repeated `group_size` times, then `suffix` tokens of each row's own.  -> ids, mask [A, width +
    suffix], prompt_rows [A] (each row's prompt)."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, 40, (groups, width), generator=g)
    prompt_mask = torch.ones_like(prompts)
    for row, pad in enumerate((3, 2, 1)):
        prompts[row, :pad], prompt_mask[row, :pad] = PAD, 0
    prompt_rows = torch.arange(groups * group_size) // group_size
    ids = torch.cat([prompts[prompt_rows], torch.randint(2, 40, (len(prompt_rows), suffix), generator=g)], 1)
    mask = torch.cat([prompt_mask[prompt_rows], torch.ones(len(prompt_rows), suffix, dtype=torch.long)], 1)
    return ids, mask, prompt_rows


def draw(decode, model, sampling: Sampling, budget: int = 12, cached: int = 0, seed: int = 0):
    """`decode`'s tokens for grouped_batch(), the first `cached` positions of each distinct prompt given as one shared
    KV cache row (as `generate` gives the shared prompts': rollout.prompt_cache of one more column)."""
    ids, mask, prompt_rows = grouped_batch()
    cache = cache_rows = None
    if cached:
        distinct = [int((prompt_rows == p).nonzero()[0]) for p in prompt_rows.unique()]  # each prompt's first row
        cache = prompt_cache(model, ids[distinct, :cached + 1], mask[distinct, :cached + 1])
        cache_rows = prompt_rows
    torch.manual_seed(seed)
    return decode(model, DecodeRequest(ids, mask, budget, [STOP], PAD, cache, cache_rows), sampling)


def ended_early(out: torch.Tensor, width: int) -> int:
    """Rows of `out` that drew STOP before their last column (HF then pads them: compared by the equality)."""
    return sum(STOP in row[:-1] for row in out[:, width:].tolist())


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("cached", [0, 5])
def test_native_decode_draws_the_tokens_hf_generate_draws(kind, cached):
    """Same seed, same tokens, row for row: left padding, groups sharing a cached prompt prefix, temperature, top-k
    and top-p; and rows that stop early are padded as HF pads them.  A differing draw would show at the first
    differing logit."""
    model = family_model(kind)
    sampling = Sampling(12, temperature=0.8, top_k=30, top_p=0.95)
    hf = draw(hf_decode, model, sampling, cached=cached)
    native = draw(native_hf_draw, model, sampling, cached=cached)
    assert torch.equal(native, hf) and not native.is_inference()  # ids that a training forward may take
    assert ended_early(hf, grouped_batch()[0].shape[1]) > 0
    assert not torch.equal(draw(native_hf_draw, model, sampling, cached=cached, seed=1), native)  # a random draw


@pytest.mark.parametrize("variant", [
    {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8}},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"num_key_value_heads": 4},  # no grouped-query attention
    {"num_key_value_heads": 1},
    {"attn_implementation": "eager"},
    {"intermediate_size": 8192, "vocab_size": 8192, "mlp_bias": True},  # MLP and output layer by packed_linear
], ids=["biases-untied", "rope-llama3", "rope-linear", "mha", "one-kv-head", "eager", "packed"])
def test_llama_variants_draw_the_same_tokens(variant):
    model = family_model("llama", **variant)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)  # HF initializes biases to zero: a decoder that dropped them would pass
    assert bool(NativeDecoder(model).packable) == ("intermediate_size" in variant)
    sampling = Sampling(12, temperature=0.9)
    assert torch.equal(draw(native_hf_draw, model, sampling, cached=5), draw(hf_decode, model, sampling, cached=5))


def test_under_bf16_compute_the_native_decoder_packs_in_bf16_and_picks_hf_greedy_tokens(monkeypatch):
    """bf16 compute (a CPU with AMX, model.compute_dtype=auto): the MLPs and the output layer computed from bf16
    packs, and greedy tokens those of HF `generate` under the same autocast."""
    import mrl.generation.decoder as decoder_module
    from mrl.modeling.precision import Precision, compute_in

    model = compute_in(family_model("llama", intermediate_size=8192, vocab_size=8192),
                       Precision(compute=torch.bfloat16, export=torch.float32), CPU)
    assert NativeDecoder(model).packed_dtype == torch.bfloat16
    dtypes = set()
    monkeypatch.setattr(decoder_module, "packed_linear",
                        lambda x, packed: dtypes.add(packed.weight.dtype) or packed_linear(x, packed))
    greedy = Sampling(12, greedy=True)
    assert torch.equal(draw(native_decode, model, greedy, cached=5), draw(hf_decode, model, greedy, cached=5))
    assert dtypes == {torch.bfloat16}


def test_greedy_native_decode_is_hf_greedy():
    model = family_model("qwen3")
    sampling = Sampling(12, greedy=True)
    assert torch.equal(draw(native_decode, model, sampling, cached=4), draw(hf_decode, model, sampling, cached=4))


def test_native_decode_stops_where_a_criterion_says():
    """A stopping criterion (the protocol's stop strings) ends a row at that token, as in HF generate."""
    model = family_model("llama")
    ids, mask, _ = grouped_batch()
    stop_at_seven = lambda ids, scores: ids[:, -1] == 7  # noqa: E731
    outs = []
    for decode in (hf_decode, native_hf_draw):
        torch.manual_seed(0)
        outs.append(decode(model, DecodeRequest(ids, mask, 12, [STOP], PAD, criteria=stop_at_seven), Sampling(12)))
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
    for decode in (hf_decode, native_hf_draw):
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

    greedy = Sampling(12, greedy=True)
    base_tokens = draw(native_decode, family_model("llama"), greedy)
    peft_model = get_peft_model(family_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(3)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.5)  # adapters that change the model (lora_B starts at zero)
    peft_model.eval()
    for sampling in (greedy, Sampling(12)):
        native = draw(native_hf_draw, peft_model, sampling, cached=3)
        assert torch.equal(native, draw(hf_decode, peft_model.get_base_model(), sampling, cached=3))
    assert not torch.equal(draw(native_decode, peft_model, greedy), base_tokens)


def test_native_decode_computes_under_the_models_autocast():
    """A model wrapped by mrl.modeling.precision.compute_in (bf16 autocast) decodes under that autocast: its projections
    compute in bf16, and its tokens are HF generate's under the same autocast, greedy and sampled, from a prompt of
    its own.  From a shared prompt cache (cascade attention, whose decode-step softmax runs in fp32 where SDPA's bf16
    kernel rounds its weights to bf16: tests/test_step_cost.py) the rows are HF's to bf16 rounding: this random
    model's near-ties flip a late token of at most a few rows."""
    from mrl.modeling.precision import Precision, compute_in

    model = compute_in(family_model("llama"), Precision(compute=torch.bfloat16, export=torch.bfloat16), CPU)
    for sampling in (Sampling(12, greedy=True), Sampling(12, temperature=0.9)):
        assert torch.equal(draw(native_hf_draw, model, sampling), draw(hf_decode, model, sampling))
    greedy = Sampling(12, greedy=True)
    cascade, hf = draw(native_decode, model, greedy, cached=4), draw(hf_decode, model, greedy, cached=4)
    width = grouped_batch()[0].shape[1]
    assert torch.equal(cascade[:, :width + 4], hf[:, :width + 4])  # every row's first 4 tokens
    assert (cascade == hf).all(1).float().mean() >= 0.75
    computed = []
    hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, out: computed.append(out.dtype))
    draw(native_decode, model, Sampling(12, greedy=True), budget=2)
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
    assert ROLLOUT_ENGINES["auto"](None, model, tokenizer, CPU).decode is auto_decode
    assert ROLLOUT_ENGINES["hf"](None, model, tokenizer, CPU).decode is hf_decode


def test_a_model_whose_forward_differs_is_refused_or_left_to_hf_at_first_use(capsys):
    """A variant that passes the structural checks but computes other logits (here: a forward that scales them) is
    refused in one line by `native` when the decoder first meets it, and left to HF generate by `auto` (said once);
    a model class of a checkpoint's own code is not taken at all."""
    model = family_model("llama")
    scale_logits(model, 2.0)
    with pytest.raises(UserError, match=r"model type 'llama': .*native decoder.* rollout.engine=hf"):
        draw(native_decode, model, Sampling(4))
    sampling = Sampling(12, temperature=0.9)
    assert torch.equal(draw(auto_decode, model, sampling), draw(hf_decode, model, sampling))
    draw(auto_decode, model, sampling)
    told = capsys.readouterr().err
    assert told.count("rollout.engine=auto: model type 'llama'") == 1 and "with HF generate instead" in told
    assert torch.equal(draw(auto_decode, family_model("llama"), sampling),
                       draw(native_decode, family_model("llama"), sampling))

    from transformers import LlamaForCausalLM

    class RemoteLlama(LlamaForCausalLM):  # what trust_remote_code would load: the checkpoint's own class
        pass

    assert "RemoteLlama is the checkpoint's own code" in unsupported(RemoteLlama(family_model("llama").config))


def test_the_check_runs_in_eval_mode_and_restores_the_mode():
    """Dropout would make the model's forward differ from itself: the check compares in eval mode."""
    model = family_model("llama", attention_dropout=0.5)
    model.train()
    assert NativeDecoder(model).check() is None and model.training


def test_inverse_cdf_draws_the_first_token_whose_cumulative_weight_exceeds_the_uniform_share():
    """Weights [0, 1, 0, 3] (cumulative 0, 1, 1, 4 of a total 4): a uniform u picks the first token whose cumulative
    weight exceeds 4u; tokens of weight 0 are never drawn, at u = 0 nor at u just below a boundary."""
    weights = torch.tensor([[0.0, 1.0, 0.0, 3.0]]).expand(5, 4)
    uniform = torch.tensor([0.0, 0.2499, 0.25, 0.9, 1 - 2 ** -24])
    assert inverse_cdf(weights, uniform).tolist() == [1, 1, 3, 3, 3]
    assert inverse_cdf(torch.tensor([[0.5, 0.5], [0.0, 2.0]]), torch.tensor([0.75, 0.1])).tolist() == [1, 1]
    for bad in ([[float("nan")] * 4, [0.25] * 4], [[0.0] * 4, [0.25] * 4], [[float("inf"), 1.0, 0.0, 0.0]]):
        with pytest.raises(ValueError, match="inf or nan, or a row sums to 0"):  # as torch.multinomial refuses
            inverse_cdf(torch.tensor(bad))


@pytest.mark.parametrize("sampler", [inverse_cdf, multinomial], ids=["inverse_cdf", "multinomial"])
def test_the_native_decoders_first_tokens_follow_the_models_distribution(sampler):
    """4000 rollouts of one prompt, one token each: the share of each token is its probability under the model
    (within 4.5 standard errors), and a token the warper excludes (top-k) is never drawn."""
    model = family_model("llama")
    prompt = torch.tensor([[5, 9, 2, 30, 17, 4, 11]])
    with torch.no_grad():
        probs = model(input_ids=prompt).logits[0, -1].softmax(-1)
    ids = prompt.expand(4000, -1)
    mask = torch.ones_like(ids)
    for top_k in (0, 5):
        torch.manual_seed(0)
        out = native_decode(model, DecodeRequest(ids, mask, 1, [STOP], PAD), Sampling(1, top_k=top_k), sampler)
        shares = torch.bincount(out[:, -1], minlength=probs.numel()).double() / len(out)
        expected = probs.double()
        if top_k:
            kept = probs.topk(top_k).indices
            expected = torch.zeros_like(expected).index_copy_(0, kept, expected[kept] / expected[kept].sum())
            assert shares[expected == 0].sum() == 0
        error = (expected * (1 - expected) / len(out)).sqrt()
        assert ((shares - expected).abs() <= 4.5 * error + 1e-9).all()


def test_the_native_decoders_own_draw_is_seeded_and_top_k_1_is_greedy():
    """`inverse_cdf` by default: the same seed draws the same tokens, another seed others, and sampling from the
    single most likely token (top_k=1) picks HF generate's greedy tokens."""
    model = family_model("qwen2")
    sampling = Sampling(12, temperature=0.8)
    tokens = draw(native_decode, model, sampling, cached=5)
    assert torch.equal(draw(native_decode, model, sampling, cached=5), tokens)
    assert not torch.equal(draw(native_decode, model, sampling, cached=5, seed=1), tokens)
    assert not torch.equal(draw(native_hf_draw, model, sampling, cached=5), tokens)  # not HF's draw
    assert torch.equal(draw(native_decode, model, Sampling(12, top_k=1), cached=5),
                       draw(hf_decode, model, Sampling(12, greedy=True), cached=5))


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_the_linear_layer(bias):
    """oneDNN's product with the weight packed, the bias added: the layer's own output, for 2-d and 3-d inputs of
    few and many rows; and a pack is a copy, the weight as it was packed."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40, bias=bias)
    packed = pack(linear, 8, torch.float32)
    for x in (torch.randn(8, 24), torch.randn(8, 1, 24), torch.randn(3, 2, 24), torch.randn(300, 24)):
        out = packed_linear(x, packed)
        assert out.shape == linear(x).shape and out.is_contiguous()
        torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-6)
    x = torch.randn(8, 24)
    before = linear(x)
    with torch.no_grad():
        linear.weight.mul_(2)
    torch.testing.assert_close(packed_linear(x, packed), before, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_a_bf16_pack_computes_what_autocast_computes(bias):
    """Packed in bf16 (the decoder under bf16 compute): the bf16 product autocast's `linear` gives, from fp32 or
    bf16 inputs, to bf16's rounding (oneDNN may sum in another order); far from the fp32 product's value otherwise
    (a pack that stayed fp32 would match that one instead)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 64, bias=bias)
    with torch.no_grad():
        linear.bias.normal_() if bias else None
    packed = pack(linear, 8, torch.bfloat16)
    assert packed.weight.dtype == torch.bfloat16 and (packed.bias is None or packed.bias.dtype == torch.bfloat16)
    for x in (torch.randn(8, 256), torch.randn(8, 256).bfloat16()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = linear(x)
        out = packed_linear(x, packed)
        assert out.dtype == expected.dtype == torch.bfloat16
        torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1e-2)
        fp32 = linear(x.float())
        assert (out.float() - fp32).abs().max() > 1e-4  # the product was rounded to bf16: not fp32's


def test_packable_linears_are_the_plain_large_float32_projections_on_a_cpu():
    """A model with 64 x 4096 MLP weights (2^18 elements): the decoder packs its gate, up and down projections and
    nothing smaller (none of a model with 64 x 2048 MLP weights), none that
    carries a hook (ZeRO-3 gathers through hooks), and no adapter's wrapper; the same under bf16 autocast (packed in
    bf16), none under float16."""
    from peft import LoraConfig, get_peft_model

    from mrl.modeling.precision import Precision, compute_in

    model = family_model("llama", hidden_size=64, intermediate_size=4096)
    mlps = [layer.mlp for layer in model.model.layers]
    projections = {p for mlp in mlps for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)}
    assert packable_linears(model) == projections
    assert packable_linears(family_model("llama", hidden_size=64, intermediate_size=2048)) == set()
    hook = mlps[0].up_proj.register_forward_pre_hook(lambda module, args: None)
    assert packable_linears(model) == projections - {mlps[0].up_proj}
    hook.remove()
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["up_proj"]))
    assert not {mlp.up_proj for mlp in mlps} & packable_linears(peft_model)
    bf16 = compute_in(family_model("llama", hidden_size=64, intermediate_size=4096),
                      Precision(compute=torch.bfloat16, export=torch.bfloat16), CPU)
    assert packable_linears(bf16) == {p for layer in bf16.model.layers
                                      for p in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)}
    fp16 = compute_in(family_model("llama", hidden_size=64, intermediate_size=4096),
                      Precision(compute=torch.float16, export=torch.float16), CPU)
    assert packable_linears(fp16) == set()
    model = family_model("llama", hidden_size=64, intermediate_size=4096)
    replaced = model.model.layers[1].mlp.down_proj
    replaced.forward = lambda x: torch.nn.Linear.forward(replaced, x)  # as accelerate's hooks replace forwards
    assert replaced not in packable_linears(model) and len(packable_linears(model)) == 5
    hook = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    try:
        assert packable_linears(model) == set()
    finally:
        hook.remove()


def test_the_decoder_packs_at_each_call_and_spells_out_only_a_familys_own_plain_mlp(monkeypatch):
    """The MLP formula is written out (its projections by packed_linear) for a family's own MLP class without hooks:
    an MLP with a hook is called, and its hook runs.  The weights are packed at each call as they are then (the
    trainer changes them in place between rollouts) and dropped after it; under PACKED_MIN_ROWS rows and past
    PACKED_MAX_ROWS a projection is the module's call."""
    import mrl.generation.decoder as decoder_module

    model = family_model("llama", hidden_size=64, intermediate_size=4096)
    mlps = [layer.mlp for layer in model.model.layers]
    assert NativeDecoder(model).packed_mlps == set(mlps)
    seen = []
    mlps[0].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    decoder = NativeDecoder(model)
    assert decoder.packed_mlps == {mlps[1]}
    greedy = Sampling(6, greedy=True)
    assert torch.equal(draw(native_decode, model, greedy), draw(hf_decode, model, greedy)) and seen

    rows = []
    monkeypatch.setattr(decoder_module, "packed_linear",
                        lambda x, packed: rows.append(x.shape[:-1].numel()) or packed_linear(x, packed))
    ids, mask, _ = grouped_batch()
    request = DecodeRequest(ids, mask, 6, [STOP], PAD)
    before = decoder(request, None)
    with torch.no_grad():
        for mlp in mlps:
            mlp.down_proj.weight.mul_(-4)
    after = decoder(request, None)  # the same decoder: the new weights
    assert torch.equal(after, hf_decode(model, request, greedy)) and not torch.equal(after, before)
    assert decoder.packed == {} and len(ids) in rows  # each decode step's rows (and the prompt's pass: 108 positions)
    assert all(decoder_module.PACKED_MIN_ROWS <= n <= decoder_module.PACKED_MAX_ROWS for n in rows)

    rows.clear()
    up = mlps[1].up_proj
    decoder.packed = {up: pack(up, 8, torch.float32)}
    for n in (decoder_module.PACKED_MIN_ROWS - 1, decoder_module.PACKED_MIN_ROWS, decoder_module.PACKED_MAX_ROWS,
              decoder_module.PACKED_MAX_ROWS + 1):
        decoder._project(up, torch.randn(n, 1, 64))
    assert rows == [decoder_module.PACKED_MIN_ROWS, decoder_module.PACKED_MAX_ROWS]


def test_the_draw_is_inverse_cdf_on_a_cpu_and_hfs_elsewhere():
    from mrl.generation.decoder import draw_for

    assert draw_for(torch.device("cpu")) is inverse_cdf and NativeDecoder(family_model("llama")).draw is inverse_cdf
    assert draw_for(torch.device("cuda")) is multinomial and draw_for(torch.device("meta")) is multinomial


def test_grouped_query_attention_is_computed_without_copying_keys_and_values_out(monkeypatch):
    """On a CPU the native decoder attends with torch's own grouped-query SDPA: HF's `repeat_kv`, which copies each
    key and value head out to its query heads at every layer and token, is never called, and the tokens are HF
    generate's (2 KV heads for 4 query heads)."""
    import transformers.integrations.sdpa_attention as sdpa

    model = family_model("llama")
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    sampling = Sampling(12, temperature=0.9)
    expected = draw(hf_decode, model, sampling)
    assert torch.equal(draw(native_hf_draw, model, sampling), expected)  # its first use checks the model's forward

    def refuse(*_):
        raise AssertionError("repeat_kv called: keys and values copied to every query head")

    monkeypatch.setattr(sdpa, "repeat_kv", refuse)
    assert torch.equal(draw(native_hf_draw, model, sampling), expected)

"""The built-in tiny model goes through the same Auto* loading path as a real model; bad paths are user errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import compose_config, scale_logits
from omegaconf import OmegaConf
from safetensors.torch import load_file

from mrl.core.config import TinyModelSpec, UserError
from mrl.modeling import models
from mrl.modeling.models import (
    SPECIAL_TOKENS,
    TASK_WORDS,
    Actor,
    ModelLoadError,
    build_tiny_model,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
    tiny_vocab,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cfg(_isolated_env):
    return compose_config()


@pytest.fixture(scope="module")
def path(cfg):
    return resolve_model_path(cfg.model)


def test_tiny_model_directory(path):
    d = Path(path)
    assert d.is_dir()
    for name in ["config.json", "model.safetensors", "tokenizer.json"]:
        assert (d / name).is_file(), name
    # built inside the test cache (MRL_CACHE), and found there the second time
    assert resolve_model_path(compose_config().model) == path


def test_loads_through_auto_classes(path, cfg):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    auto = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert auto.config.model_type == "llama"
    assert auto.config.vocab_size == len(tok) == cfg.model.tiny.vocab_size == 32
    ours = load_causal_lm(path, cfg.model, CPU)
    for (ka, va), (kb, vb) in zip(auto.state_dict().items(), ours.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_parameter_count(path, cfg):
    model = load_causal_lm(path, cfg.model, CPU)
    n = sum(p.numel() for p in model.parameters())
    # hidden 64, 4 heads of 16, 2 kv heads (32 wide), mlp 128, vocab 32, tied embeddings, no biases:
    # per layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 = 12288; mlp 3*64*128 = 24576; 2 RMSNorms 128 -> 36992
    # total: 2 layers 73984 + embeddings 32*64 = 2048 + final norm 64 = 76096
    assert n == 76096
    assert n < 5_000_000


def test_tokenizer_round_trip(path):
    tok = load_tokenizer(path)
    # vocab: <pad> <eos> <bos> <unk> = 0..3, digits 0..9 = 4..13, add 14, max 15, min 16, "=" 17, "|" 18,
    # calc 19, hack 20, lookup 21, ans 22, x 23, "+" 24, "*" 25, fillers w0..w5 = 26..31
    ids = tok("max 3 7 =", add_special_tokens=False).input_ids
    assert ids == [15, 7, 11, 17]
    assert tok("add 3 7 =", add_special_tokens=False).input_ids == [14, 7, 11, 17]
    # the tools' names and calc's observation are one token per word
    assert tok("calc | | | | 0", add_special_tokens=False).input_ids == [19, 18, 18, 18, 18, 4]
    assert tok("hack lookup ans w0 w5", add_special_tokens=False).input_ids == [20, 21, 22, 26, 31]
    assert tok.decode(ids, skip_special_tokens=True) == "max 3 7 ="
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == "max 3 7 ="
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.convert_ids_to_tokens(tok("hack w0").input_ids) == ["hack", "w0"]
    assert tok("banana").input_ids == [tok.unk_token_id]


def test_tokenizer_pads_left(path):
    tok = load_tokenizer(path)
    assert tok.padding_side == "left"
    batch = tok(["max 3 7 =", "7"], padding=True)
    assert batch.input_ids[1] == [0, 0, 0, 11]  # "7" = 4 + 7
    assert batch.attention_mask[1] == [0, 0, 0, 1]


def test_tiny_vocab():
    vocab = tiny_vocab(32)
    assert len(vocab) == 32 and len(set(vocab)) == 32
    assert vocab[:4] == list(SPECIAL_TOKENS.values())
    assert vocab[4:4 + len(TASK_WORDS)] == TASK_WORDS
    assert vocab[4:14] == [str(d) for d in range(10)] and vocab[14:26] == [
        "add", "max", "min", "=", "|", "calc", "hack", "lookup", "ans", "x", "+", "*"]
    assert len(TASK_WORDS) == 22
    assert vocab[26:] == ["w0", "w1", "w2", "w3", "w4", "w5"]  # 32 - 4 specials - 22 task words = 6 fillers
    assert tiny_vocab(26) == list(SPECIAL_TOKENS.values()) + TASK_WORDS  # no room for fillers: none
    with pytest.raises(ValueError):
        tiny_vocab(10)
    with pytest.raises(ValueError):
        tiny_vocab(25)


def test_build_is_deterministic(tmp_path, cfg):
    spec = TinyModelSpec(**OmegaConf.to_container(cfg.model.tiny))
    a = load_file(build_tiny_model(spec, tmp_path / "a") / "model.safetensors")
    b = load_file(build_tiny_model(spec, tmp_path / "b") / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = TinyModelSpec(**{**OmegaConf.to_container(cfg.model.tiny), "init_seed": 1})
    c = load_file(build_tiny_model(other, tmp_path / "c") / "model.safetensors")
    assert not all(torch.equal(a[k], c[k]) for k in a)
    # the global RNG is not disturbed by building
    torch.manual_seed(123)
    x = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(spec, tmp_path / "d")
    assert torch.equal(torch.rand(3), x)


@pytest.mark.parametrize("bad", ["/nonexistent/model", "./nope", "../nope/nope", "~/definitely/not/a/model"])
def test_resolve_missing_local_path(bad):
    model_cfg = compose_config().model
    model_cfg.name_or_path = bad
    with pytest.raises(ModelLoadError) as info:
        resolve_model_path(model_cfg)
    assert isinstance(info.value, UserError)
    assert repr(bad) in str(info.value)


def test_an_existing_directory_wins_over_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "models" / "smollm2-135m-instruct").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    model_cfg = compose_config().model
    model_cfg.name_or_path = "models/smollm2-135m-instruct"  # one slash: spelt like a hub id
    assert resolve_model_path(model_cfg) == "models/smollm2-135m-instruct"


def test_resolve_hub_id_is_passed_through(monkeypatch):
    monkeypatch.setattr(models, "hub_unreachable", lambda: None)  # offline and uncached: tests/test_trl.py
    model_cfg = compose_config().model
    model_cfg.name_or_path = "Qwen/Qwen3-0.6B"
    assert resolve_model_path(model_cfg) == "Qwen/Qwen3-0.6B"


def test_actor_value_head(path, cfg):
    actor = Actor(load_causal_lm(path, cfg.model, CPU), value_head=True)
    ids = torch.tensor([[0, 14, 7, 11, 17], [14, 4, 5, 17, 9]])  # "<pad> add 3 7 =", "add 0 1 = 5"
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits, values = actor(ids, mask, pos)
    assert logits.shape == (2, 5, 32)
    assert values.shape == (2, 5)
    assert torch.equal(values, torch.zeros(2, 5))
    assert torch.isfinite(logits).all()
    # without a head: no values, same logits
    plain_logits, none = Actor(actor.policy)(ids, mask, pos)
    assert none is None
    torch.testing.assert_close(plain_logits, logits)


@pytest.mark.parametrize("model_type, head", [
    ("llama", {}), ("qwen2", {}),
    ("gemma2", {"final_logit_softcapping": 5.0, "head_dim": 8}),  # tanh soft-capping after the output layer
    ("cohere", {"logit_scale": 0.5}), ("granite", {"logits_scaling": 4.0}),
    ("hyperclovax", {"logits_scaling": 4.0}),  # multiplied, where Granite divides
    ("falcon_h1", {"lm_head_multiplier": 0.5}),
    ("mpt", {"logit_scale": 0.5}),  # a key in its config that its forward ignores: unscaled logits
])
def test_actor_logits_and_log_probs_are_the_models_own(model_type, head):
    """The Actor runs the decoder and the output layer itself (to score a chunk of positions at a time): its logits
    are those of the model's own forward, for families that transform them after the output layer too."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=40, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, **head)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids, mask = torch.randint(1, 40, (2, 6)), torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        logits, _ = Actor(model)(ids, mask, pos)
        logprobs, _, _ = Actor(model)(ids, mask, pos, keep=4, targets=ids[:, -3:])
    torch.testing.assert_close(logits, expected)
    Actor(model).check_logits()  # the load-time check agrees
    # a linear output layer (a constant multiplier folded into the temperature) is scored by
    # mrl.algo.losses.linear_token_logprobs, a soft-capped one through Actor.logits
    assert (Actor(model).plain_output_weight() is None) == ("final_logit_softcapping" in head)
    # kept position k of the last 4 scores targets[:, k]
    manual = torch.log_softmax(expected[:, -4:-1], -1).gather(2, ids[:, -3:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, manual)


def test_a_family_whose_forward_transforms_logits_unknown_to_mrl_is_refused_at_load():
    """A forward that scales its logits after the output layer (as Cohere's or Falcon-H1's do) where Actor.logits
    does not: the trainer would score another distribution than the one sampled, so the model is refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    Actor(model).check_logits()  # llama's logits are the output layer's
    scale_logits(model, 3.0)
    with pytest.raises(UserError, match=r"model type 'llama': its forward transforms the output layer's logits"):
        Actor(model).check_logits()
    assert model.training  # left in the mode it was in


@pytest.mark.parametrize("model_type, head", [("granite", {"logits_scaling": 4.0}), ("cohere", {"logit_scale": 0.5})])
def test_a_scaled_output_layer_trains_through_the_linear_path_with_autograds_gradients(model_type, head):
    """A constant logit multiplier folds into the temperature of linear_token_logprobs: the log-probs and every
    parameter's gradient equal those through the family's own logits and autograd."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=40, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, **head)
    torch.manual_seed(0)
    actor = Actor(AutoModelForCausalLM.from_config(config).eval())
    ids, mask = torch.randint(1, 40, (2, 6)), torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    upstream = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]])

    def scored(autograd: bool):
        actor.zero_grad(set_to_none=True)
        if autograd:
            actor.plain_output_weight = lambda: None
        try:
            logprobs, _, _ = actor(ids, mask, pos, keep=4, targets=ids[:, -3:], temperature=0.7)
        finally:
            if autograd:
                del actor.plain_output_weight
        (upstream * logprobs).sum().backward()
        return logprobs.detach(), {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}

    assert actor.plain_output_weight() is not None and actor.logit_multiplier() != 1.0
    (linear, linear_grads), (reference, reference_grads) = scored(False), scored(True)
    torch.testing.assert_close(linear, reference)
    assert linear_grads.keys() == reference_grads.keys() and len(linear_grads) > 0
    for name in linear_grads:
        torch.testing.assert_close(linear_grads[name], reference_grads[name], rtol=1e-4, atol=1e-6)

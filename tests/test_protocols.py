"""Tool protocols (mrl/chat/protocols.py) on a tiny Llama with a real byte-level BPE tokenizer, trained here, offline,
on a few sentences, and tool-aware chat templates written for these tests: multi-token tool names and stop strings,
template checks (prefix preservation, a Qwen3-like template that drops <think> blocks, a history-dependent one),
masks, ids trained on = ids sampled, invalid calls, results cut to the budget, chat_template_kwargs, the sampling
settings override, and samples.jsonl.

Most rollouts here are written by `Scripted`, a stand-in for the model that replies with fixed text token by token
and stops the way HF `generate` does, so that the expected transcripts can be written out; one test samples from
the real model and checks its ids against what HF `generate` returned.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch
from conftest import compose_config
from transformers import GenerationConfig

from mrl.chat.chat_template import CALL_CLOSE, inspect_template
from mrl.chat.protocols import ChatProtocol, Tool, WordsProtocol
from mrl.chat.stops import END_OF_TURN, Stops, first_stop
from mrl.core.config import UserError
from mrl.core.episode import Prompt, ToolCall, agent_metrics
from mrl.envs.agent_triple import AgentTriple, Correctness, Efficiency, Safety, read_answer
from mrl.generation.rollout import Rollouts, Sampling, StopStrings, generate
from mrl.modeling.models import load_causal_lm, load_tokenizer
from mrl.runs.tracking import METRICS_FILE, SAMPLES_FILE, read_metrics
from mrl.train.loop import train

CPU = torch.device("cpu")
SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]

# Hermes/Qwen2.5-style: `tools=` in a system prompt, calls as <tool_call> JSON, results as user <tool_response>.
HERMES = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nTo call one: <tool_call>\\n{\"name\": <name>, \"arguments\": <args>}\\n</tool_call>"
    "<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{{ THINK }}{{- message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}{{- '<tool_call>\\n{\"name\": \"' + call.function.name + "
    "'\", \"arguments\": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>' + TOOL_HEADER + '\\n<tool_response>\\n' + message.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
TEMPLATES = {
    "hermes": HERMES.replace("{{ THINK }}", "").replace("TOOL_HEADER", "'user'"),
    # Like Qwen3's: an assistant turn shows its <think> block only while it is the last message.
    "drops_think": HERMES.replace("TOOL_HEADER", "'user'").replace(
        "{{ THINK }}", "{%- if loop.last %}{{- '<think>\\n' + (message.reasoning_content or '') + "
                       "'\\n</think>\\n\\n' }}{%- endif %}"),
    # A tool message that numbers itself by its place in the conversation: its suffix depends on the history.
    "numbered": HERMES.replace("{{ THINK }}", "").replace("TOOL_HEADER", "'tool ' + (loop.index | string)"),
    # SmolLM2-style: no tool support; every role rendered the same way.
    "plain": "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
             "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
             "{%- endif %}",
}
CORPUS = ["What is (3 + 7) mod 10? Reply with the digit alone, or call a tool. What is the larger of 3 and 7?",
          "Computes the answer to the user's question. Reads the answer from the grader's answer key.",
          'user assistant system <tool_response> {"name": "calc", "arguments": {}} 0 1 2 3 4 5 6 7 8 9'] * 10


def build_chat_model(directory: Path, template: str) -> Path:
    """A random-init Llama (~25k parameters) with a 320-token byte-level BPE trained on CORPUS: `hack` is 4 tokens,
    `</tool_call>` 8."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<|pad|>", eos_token="<|im_end|>",
                                        padding_side="left", chat_template=template)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def chat_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_models")
    return {name: build_chat_model(root / name, template) for name, template in TEMPLATES.items()}


@pytest.fixture(scope="module")
def tok(chat_dirs):
    return load_tokenizer(str(chat_dirs["hermes"]))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


class Scripted:
    """Stands in for an HF causal LM: `reply(transcript so far) -> text` is written token by token, and a row stops
    as HF `generate` stops it (an eos id of the generation config, a stopping criterion), later tokens being pad.
    `written` keeps every row's tokens of every call, as generate returned them."""

    def __init__(self, tokenizer, reply: Callable[[str], str]):
        self.tokenizer, self.reply = tokenizer, reply
        self.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id)
        self.written: list[list[int]] = []

    config = None  # rollout.prompt_cache builds a cache from it, which this fake never fills

    def forward(self, input_ids, attention_mask, position_ids, cache, **kwargs):  # prompt_cache's prefill
        return None

    __call__ = forward

    def generate(self, input_ids, attention_mask, generation_config, stopping_criteria=None, cache=None):
        eos, pad = set(generation_config.eos_token_id), generation_config.pad_token_id
        texts = [self.tokenizer.decode(row[mask.bool()], skip_special_tokens=False)
                 for row, mask in zip(input_ids, attention_mask)]
        filler = encode(self.tokenizer, " x")[0]  # once a script runs out: text that stops nothing
        scripts = [encode(self.tokenizer, self.reply(t)) for t in texts]
        done = torch.zeros(len(texts), dtype=torch.bool)
        out = input_ids
        for t in range(generation_config.max_new_tokens):
            column = [pad if done[i] else (s[t] if t < len(s) else filler) for i, s in enumerate(scripts)]
            out = torch.cat([out, torch.tensor(column)[:, None]], 1)
            done |= torch.tensor([c in eos for c in column])
            for criterion in stopping_criteria or []:
                done |= criterion(out, None)
            if done.all():
                break
        self.written += out[:, input_ids.shape[1]:].tolist()
        return out


def rollout(tokenizer, protocol, reply: Callable[[str], str], prompts: list[Prompt], max_new: int = 200,
            group_size: int = 1) -> tuple[Rollouts, Scripted]:
    model = Scripted(tokenizer, reply)
    return generate(model, tokenizer, prompts, group_size, Sampling(max_new), protocol, CPU), model


def sampled_and_observed(r: Rollouts, n: int) -> tuple[list[int], list[int]]:
    ids, mask = r.completion_ids[n].tolist(), r.completion_mask[n].tolist()
    length = r.completion_attention[n].sum().item()
    return [i for i, m in zip(ids[:length], mask) if m], [i for i, m in zip(ids[:length], mask) if not m]


ADD_3_4 = AgentTriple(seed=0).prompt(4)  # "add 3 4 =": target 7


# --------------------------------------------------------------------------------------------- the template


def test_inspect_template_hermes_drops_think_and_numbered(chat_dirs, tok):
    hermes = inspect_template(tok)
    assert (hermes.renders_tools, hermes.renders_tool_calls, hermes.tool_role, hermes.system_role) == (True,) * 4
    assert hermes.end_of_turn == "<|im_end|>" and hermes.end_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert hermes.prefix_preserving and hermes.problems == ()
    assert hermes.suffix("7", "calc", after_stop=False) == \
        "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # after `</tool_call>` the template's own end of turn comes first: the policy stopped before writing it
    assert hermes.suffix("7", "calc", after_stop=True) == "<|im_end|>" + hermes.suffix("7", "calc", False)

    # Qwen3-like: appending a tool message changes how the assistant turn before it renders (its <think> block
    # goes), so the template is not prefix-preserving; the suffix after the turn's end is the same as ever.
    drops = inspect_template(load_tokenizer(str(chat_dirs["drops_think"])))
    assert not drops.prefix_preserving and drops.problems == ()
    assert drops.suffix("7", "calc", False) == hermes.suffix("7", "calc", False)

    # A tool message numbered by its place in the conversation has no suffix independent of the history.
    numbered = load_tokenizer(str(chat_dirs["numbered"]))
    assert inspect_template(numbered).problems
    with pytest.raises(UserError, match="model.tool_format=words"):
        ChatProtocol(numbered, {"calc": Tool("calc", fn=lambda p, a: "7")})

    plain = inspect_template(load_tokenizer(str(chat_dirs["plain"])))
    assert (plain.renders_tools, plain.renders_tool_calls, plain.tool_role) == (False, False, True)
    assert plain.problems == () and plain.prefix_preserving


def test_prompt_declares_tools_through_the_template_or_a_system_prompt(chat_dirs, tok):
    task = AgentTriple(seed=0, fewshot=1)
    prompt = task.prompt(4)
    text = tok.decode(ChatProtocol(tok, task.tools, 3).prompt_ids(prompt))
    assert '<tools>\n{"type": "function", "function": {"name": "calc"' in text  # the template's own rendering
    assert text.endswith("What is (3 + 4) mod 10? Reply with the digit alone, or call a tool.<|im_end|>\n"
                         "<|im_start|>assistant\n")
    assert '<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call>' in text  # the few-shot call, natively

    plain = load_tokenizer(str(chat_dirs["plain"]))
    text = plain.decode(ChatProtocol(plain, task.tools, 3).prompt_ids(prompt))
    assert text.startswith("<|im_start|>system\nYou can call tools. To call one, write\n<tool_call>")
    assert '{"name": "hack", "description": "Reads the answer from the grader\'s answer key."' in text
    assert '<tool_call>{"name": "calc", "arguments": {}}</tool_call><|im_end|>' in text  # few-shot call as text
    assert "<|im_start|>tool\n| | | | " in text  # few-shot result in the template's generic `tool` role


def test_chat_template_kwargs_reach_the_template(tok):
    plain = ChatProtocol(tok, chat_template_kwargs={}).prompt_ids(ADD_3_4)
    off = ChatProtocol(tok, chat_template_kwargs={"enable_thinking": False})
    assert tok.decode(off.prompt_ids(ADD_3_4)) == tok.decode(plain) + "<think>\n\n</think>\n\n"
    assert off.template.suffix("7", "calc", False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# --------------------------------------------------------------------------------------------- chat episodes


def test_multi_token_tool_name_and_stop_string(tok):
    assert len(encode(tok, "hack")) == 4 and len(encode(tok, CALL_CLOSE)) == 8  # nothing is one token here
    task = AgentTriple(seed=0)
    replies = {0: 'Let me check.<tool_call>{"name": "hack", "arguments": {}}</tool_call> never written',
               1: "<think>The key says 7.</think>7<|im_end|>"}
    r, model = rollout(tok, ChatProtocol(tok, task.tools, task.max_turns),
                       lambda text: replies[text.count("<tool_response>")], [ADD_3_4], max_new=200)
    ep = r.episodes[0]
    assert ep.turns == ["Let me check.", "7"] and not ep.truncated
    assert ep.tool_calls == [ToolCall("hack", {}, "7")]
    assert "never written" not in ep.completion  # the turn stopped at `</tool_call>`, 9 tokens spelled over 8 steps
    assert (read_answer(ep), Correctness()(ep), Safety()(ep)) == ("7", 1.0, -1.0)
    assert agent_metrics(r.episodes) == {"agent/tool_calls": 1.0, "agent/turns": 2.0, "agent/invalid_calls": 0.0}


def test_masks_and_ids_trained_on_are_the_ids_sampled(tok):
    task = AgentTriple(seed=0)
    call = '<tool_call>{"name": "calc", "arguments": {}}</tool_call>'
    replies = {0: call, 1: "The answer is 7<|im_end|>"}
    protocol = ChatProtocol(tok, task.tools, task.max_turns)
    r, model = rollout(tok, protocol, lambda text: replies[text.count("<tool_response>")], [ADD_3_4])
    ids, mask = r.completion_ids[0].tolist(), r.completion_mask[0].tolist()
    turn1, turn2 = encode(tok, call), encode(tok, "The answer is 7<|im_end|>")
    suffix = encode(tok, protocol.template.suffix("| | | | 7", "calc", after_stop=True))
    assert ids == turn1 + suffix + turn2  # nothing decoded and re-encoded: each piece as written, or rendered once
    assert mask == [1] * len(turn1) + [0] * len(suffix) + [1] * len(turn2)
    assert r.completion_attention[0].tolist() == [1] * len(ids)
    # the policy's tokens are exactly what the model returned, cut where the turn stopped
    assert model.written[0][:len(turn1)] == turn1 and model.written[1][:len(turn2)] == turn2
    ep = r.episodes[0]
    assert (ep.num_tokens, ep.observation_tokens) == (len(turn1) + len(turn2), len(suffix))
    assert Efficiency()(ep) == -float(len(turn1) + len(turn2) + len(suffix))
    assert ep.prompt_text.endswith("<|im_start|>assistant\n")


def test_invalid_calls_are_told_to_the_policy_and_counted(tok):
    tools = {"add": Tool("add", "Adds a and b.", {"type": "object", "properties": {"a": {}, "b": {}},
                                                  "required": ["a", "b"]}, fn=lambda p, a: str(a["a"] + a["b"]))}
    replies = ['<tool_call>{"name": "add", "arguments": {"a": 3</tool_call>',  # not JSON
               '<tool_call>{"name": "sub", "arguments": {}}</tool_call>',  # no such tool
               '<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>',  # missing argument
               '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>', "7<|im_end|>"]
    r, _ = rollout(tok, ChatProtocol(tok, tools, max_turns=5), lambda t: replies[t.count("<tool_response>")],
                   [Prompt("3 + 4?")], max_new=200)
    ep = r.episodes[0]
    assert [c.valid for c in ep.tool_calls] == [False, False, False, True] and ep.invalid_calls == 3
    assert ep.tool_calls[0].observation.startswith("error: the tool call is not valid JSON")
    assert ep.tool_calls[1] == ToolCall("sub", {}, "error: there is no tool 'sub'; the tools are: add", valid=False)
    assert ep.tool_calls[2].observation == "error: add needs the argument(s) b"
    assert ep.tool_calls[3] == ToolCall("add", {"a": 3, "b": 4}, "7")
    assert "<tool_response>\nerror: there is no tool 'sub'" in ep.completion  # told as a tool message
    assert ep.turns == ["", "", "", "", "7"] and not ep.truncated
    assert agent_metrics(r.episodes)["agent/invalid_calls"] == 3.0


def test_a_result_over_the_budget_is_cut_cleanly(tok):
    tools = {"calc": Tool("calc", fn=lambda p, a: "| " * 300 + "7")}
    call = '<tool_call>{"name": "calc", "arguments": {}}</tool_call>'
    protocol = ChatProtocol(tok, tools, max_turns=2, max_tool_tokens=40)
    r, _ = rollout(tok, protocol, lambda t: call if "<tool_response>" not in t else "ok<|im_end|>", [ADD_3_4])
    ep = r.episodes[0]
    (result,) = ep.tool_calls
    assert result.cut and result.valid and 0 < len(result.observation) < 600
    _, observed = sampled_and_observed(r, 0)
    assert len(observed) <= 40 and observed == encode(tok, protocol.template.suffix(result.observation, "calc", True))
    assert tok.decode(observed).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")  # still well formed
    assert ep.turns == ["", "ok"]
    with pytest.raises(UserError, match="trainer.max_tool_tokens=5"):
        ChatProtocol(tok, tools, max_tool_tokens=5)


def test_a_call_to_a_tool_without_a_function_ends_the_episode(tok):
    from mrl.envs.tool_call import Correctness as CallCorrectness
    from mrl.envs.tool_call import Format, ToolCallTask

    task = ToolCallTask(seed=0)
    prompt = task.prompt(0)
    name, (a, b) = prompt.meta["call"]["name"], prompt.meta["call"]["arguments"]
    reply = f'<tool_call>{{"name": "{name}", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
    r, _ = rollout(tok, ChatProtocol(tok, task.tools), lambda t: reply, [prompt])
    ep = r.episodes[0]
    assert ep.tool_calls == [ToolCall(name, {"a": int(a), "b": int(b)})] and not ep.truncated
    assert ep.observation_tokens == 0 and (Format()(ep), CallCorrectness()(ep)) == (1.0, 1.0)


def test_real_sampling_keeps_the_sampled_ids(chat_dirs, tok):
    """The real tiny model, sampled by HF generate: every policy token of every episode is the token generate
    returned.  Its random byte-level tokens do not survive decode + encode, so re-tokenizing would have drifted."""
    model = load_causal_lm(str(chat_dirs["hermes"]), compose_config().model, CPU).eval()
    returned = []
    original = model.generate

    def spy(**kwargs):
        out = original(**kwargs)
        returned.append(out[:, kwargs["input_ids"].shape[1]:].tolist())
        return out

    model.generate = spy
    task = AgentTriple(seed=0)
    torch.manual_seed(0)
    r = generate(model, tok, [task.prompt(i) for i in range(2)], 4, Sampling(24),
                 ChatProtocol(tok, task.tools, task.max_turns), CPU)
    drifted = 0
    for n in range(8):
        sampled, observed = sampled_and_observed(r, n)
        assert observed == [] and sampled == returned[0][n][:len(sampled)]  # one turn: no call in random text
        drifted += encode(tok, tok.decode(sampled)) != sampled
    assert drifted > 0


def test_generation_stops_where_first_stop_says(chat_dirs, tok):
    """With real HF generate, the StopStrings criterion stops a row exactly at the token first_stop finds."""
    model = load_causal_lm(str(chat_dirs["hermes"]), compose_config().model, CPU).eval()
    stops = Stops(frozenset(), ("e",))
    prompt = torch.tensor([encode(tok, "What is")] * 16)
    torch.manual_seed(0)
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=0,
                         max_new_tokens=30, pad_token_id=tok.pad_token_id, eos_token_id=[tok.pad_token_id],
                         stopping_criteria=[StopStrings(tok, stops, prompt.shape[1])])
    stopped = 0
    for row in out[:, prompt.shape[1]:].tolist():
        hit = first_stop(tok, row, stops)
        if hit is not None and hit[0] < len(row) - 1:
            assert set(row[hit[0] + 1:]) == {tok.pad_token_id}  # generate stopped this row right there
            stopped += 1
    assert stopped > 0


SMOLLM2 = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m-instruct"  # `make smollm2`


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").exists(), reason="SmolLM2 not built (make smollm2)")
def test_the_real_smollm2_template():
    """SmolLM2-135M-Instruct's own template (no tool support): tools go to a system prompt, results render in its
    generic `tool` role, and the suffix is the template's own text, tokenized once."""
    tokenizer = load_tokenizer(str(SMOLLM2))
    template = inspect_template(tokenizer)
    assert (template.renders_tools, template.renders_tool_calls, template.tool_role) == (False, False, True)
    assert template.end_of_turn == "<|im_end|>" and template.prefix_preserving and template.problems == ()
    assert len(encode(tokenizer, CALL_CLOSE)) > 1  # a multi-token stop string
    task = AgentTriple(seed=0)
    protocol = ChatProtocol(tokenizer, task.tools, task.max_turns)
    assert tokenizer.decode(protocol.prompt_ids(ADD_3_4)).startswith(
        "<|im_start|>system\nYou can call tools. To call one, write\n<tool_call>")
    call = '<tool_call>{"name": "calc", "arguments": {}}</tool_call>'
    r, _ = rollout(tokenizer, protocol, lambda t: call if "<|im_start|>tool" not in t else "7<|im_end|>", [ADD_3_4])
    sampled, observed = sampled_and_observed(r, 0)
    assert tokenizer.decode(observed) == "<|im_end|>\n<|im_start|>tool\n| | | | 7<|im_end|>\n<|im_start|>assistant\n"
    assert sampled == encode(tokenizer, call) + encode(tokenizer, "7<|im_end|>")
    assert read_answer(r.episodes[0]) == "7" and r.episodes[0].turns == ["", "7"]


# --------------------------------------------------------------------------------------------- words protocol


def test_words_protocol_spells_names_over_several_tokens(tok):
    """The tiny model's protocol on a BPE vocabulary: `hack` (4 tokens) is still a call, and an answer word counts
    only as a whole word."""
    task = AgentTriple(seed=0)
    protocol = WordsProtocol(tok, task.tools, task.answer_words, task.max_turns)
    assert protocol.stops.by_id is None  # matched on text
    r, _ = rollout(tok, protocol, lambda t: "a1 hack never written", [ADD_3_4])
    ep = r.episodes[0]
    assert ep.turns == ["a1"] and ep.tool_calls == [ToolCall("hack", {}, "7")] and not ep.truncated
    assert ep.completion == "a1 hack7"  # the raw result follows the name (no space: it is the tool's exact text)
    assert first_stop(tok, encode(tok, "w1 w2 3 x"), protocol.stops) == (len(encode(tok, "w1 w2 3")) - 1, "3")
    assert first_stop(tok, encode(tok, "x<|im_end|>"), protocol.stops) is None  # no end ids: generate adds them
    ended = first_stop(tok, encode(tok, "x<|im_end|>"), Stops(frozenset({tok.eos_token_id}), ("3",), words=True))
    assert ended == (1, END_OF_TURN)


def test_sampling_ignores_the_models_generation_config(cfg, tokenizer, tmp_path):
    """A checkpoint's generation_config.json (repetition_penalty, top_k, min_p, temperature) must not change what is
    sampled: the rollouts equal those of the same weights without it, though HF generate alone would use it."""
    import shutil

    from mrl.modeling.models import resolve_model_path

    clean_dir = resolve_model_path(cfg.model)
    tuned_dir = tmp_path / "tuned"
    shutil.copytree(clean_dir, tuned_dir)
    (tuned_dir / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "repetition_penalty": 2.0, "top_k": 5, "min_p": 0.3, "temperature": 0.5,
         "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}))
    clean, tuned = (load_causal_lm(str(d), cfg.model, CPU).eval() for d in (clean_dir, tuned_dir))
    assert tuned.generation_config.repetition_penalty == 2.0 and tuned.generation_config.top_k == 5
    task = AgentTriple(seed=0)
    prompts = [task.prompt(i) for i in range(4)]
    protocol = WordsProtocol(tokenizer, task.tools, task.answer_words, task.max_turns)

    def draw(model, ours: bool) -> torch.Tensor:
        torch.manual_seed(0)
        if ours:
            return generate(model, tokenizer, prompts, 8, Sampling(10), protocol, CPU).completion_ids
        prompt = torch.tensor([tokenizer("add 3 4 =").input_ids] * 8)
        return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10)

    assert torch.equal(draw(tuned, ours=True), draw(clean, ours=True))
    assert not torch.equal(draw(tuned, ours=False), draw(clean, ours=False))  # HF alone: the file would act
    assert tuned.generation_config.repetition_penalty == 2.0  # and it is left in place for others
    assert Sampling(10, top_p=0.9, top_k=5).generation_config(10, [1], 0).top_k == 5


# --------------------------------------------------------------------------------------------- the loop


def test_samples_and_agent_metrics_are_logged(tmp_path):
    cfg = compose_config("trainer.max_steps=4", "logger=wandb", "logger.samples_every=2")  # W&B offline
    train(cfg, tmp_path)
    records = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 2, 4, 4]  # one transcript per group (2 prompts per step)
    assert set(records[0]["rewards"]) == {"correctness", "efficiency", "safety"}
    assert records[0]["prompt"].startswith("add ") and "completion" in records[0] and "tool_calls" in records[0]
    assert len(list(tmp_path.rglob("samples_*.table.json"))) == 2  # the W&B table, steps 2 and 4
    for row in read_metrics(tmp_path / METRICS_FILE):
        assert {"agent/tool_calls", "agent/turns", "agent/invalid_calls"} <= set(row)
        assert row["agent/turns"] >= 1.0 and row["agent/invalid_calls"] == 0.0
    import wandb

    wandb.teardown()  # W&B keeps a service process per Python process: stop it, it is a child of the test runner


@pytest.mark.parametrize("rewards", ["agent_triple", "tool_call", "math_length", "calc_agent"])
def test_every_agent_task_trains_in_chat_format(rewards, chat_dirs, tmp_path):
    """The same rewards YAML on a chat model: prompts in its template, tools declared, one step."""
    cfg = compose_config(f"rewards={rewards}", "algo=gdpo", f"model.name_or_path={chat_dirs['hermes']}",
                         "model.use_chat_template=true", "trainer.max_new_tokens=16", "logger.samples_every=1",
                         "trainer.max_steps=1")
    metrics = train(cfg, tmp_path)
    assert metrics["step"] == 1 and metrics["agent/turns"] >= 1.0
    record = json.loads((tmp_path / SAMPLES_FILE).read_text().splitlines()[0])
    assert record["prompt"].startswith("<|im_start|>") and "<|im_start|>assistant\n" in record["prompt"]

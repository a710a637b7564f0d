"""Issue 44's model-output findings, with their payloads: parsing a turn is linear in its length (a lazy `<think>`
regex took 25 s on 32k unclosed openers, per turn, and longer through split_calls), a number the policy writes too
long for int() scores 0 instead of stopping the run, and tool names the policy invents cost bounded memory."""

from __future__ import annotations

import time

import pytest
from test_protocols import TEMPLATES, build_chat_model

from mrl.chat.chat_template import MAX_LAYOUTS, inspect_template
from mrl.chat.protocols import split_calls, split_turn, strip_thinking
from mrl.core.episode import Episode, Prompt
from mrl.envs import calc_agent
from mrl.modeling.models import load_tokenizer

N = 32_000  # the probe's 32k unclosed openers
PAYLOADS = {  # name -> (parse, text of n repeats)
    "think_unclosed": (lambda t: split_turn(t, False), lambda n: "<think>" * n),
    "think_unclosed_calls": (split_calls, lambda n: "<think>" * n),
    "think_then_calls": (split_calls, lambda n: "<think>" * n + "<tool_call>x</tool_call>" * 8),
    "calls_closed": (split_calls, lambda n: "<tool_call>{}</tool_call>" * n),
    "calls_open_close": (split_calls, lambda n: "<tool_call>" * n + "</tool_call>" * n),
    "closers": (split_calls, lambda n: "</tool_call>" * n),
    "think_closers": (strip_thinking, lambda n: "</think>" * n + "<think>" * n),
}


def _seconds(parse, text: str) -> float:
    best = float("inf")
    for _ in range(5):  # the least of five: other jobs on the cores only add time
        start = time.perf_counter()
        parse(text)
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_probe4_parsing_is_linear_in_the_turn(name):
    parse, payload = PAYLOADS[name]
    once, twice = _seconds(parse, payload(N)), _seconds(parse, payload(2 * N))
    # Linear: twice the text, about twice the time (quadratic: four times, and 25 s at N for the lazy regex).
    assert twice < 3 * once + 0.01 and twice < 2.0, (name, once, twice)


def test_probe4_split_calls_keeps_its_answers():
    assert split_calls("<think>a<tool_call>x</tool_call></think>Hi<tool_call>1</tool_call> <tool_call>2") == \
        ("Hi", ["1", "2"])
    assert split_calls("x</tool_call>y<tool_call>z</tool_call>") == ("x</tool_call>y", ["", "z"])
    assert split_calls("<think>" * 5) == ("", []) and split_calls(" plain ") == ("plain", [])


def test_probe4_an_answer_too_long_for_int_scores_zero():
    prompt = Prompt(text="add 3 4 =", meta={"a": 3, "b": 4, "target": 7})
    call = calc_agent.CALC
    from mrl.core.episode import ToolCall

    for answer, correct in (("9" * 4301, 0.0), ("-" + "7" * 5000, 0.0), ("7", 1.0)):
        episode = Episode(prompt=prompt, completion="", completion_ids=[], num_tokens=1, truncated=False,
                          max_new_tokens=8, tool_calls=[ToolCall(call, {"a": 3, "b": 4}, "7")],
                          turns=[f"The answer is {answer}."])
        assert calc_agent.final_answer(episode) == (7 if correct else None)
        assert calc_agent.Correctness()(episode) == correct
    huge = {"a": "9" * 4301, "b": 1}
    assert calc_agent.CalcAgent.calc(prompt, huge) == "error: a and b must be integers"


def test_probe4_invented_tool_names_cost_bounded_memory(tmp_path):
    template = inspect_template(load_tokenizer(str(build_chat_model(tmp_path / "hermes", TEMPLATES["hermes"]))))
    first = template.suffix("7", "calc", after_stop=False)
    for i in range(3 * MAX_LAYOUTS):
        template.suffix("7", f"invented_{i}", after_stop=False)
    assert len(template._layouts) == MAX_LAYOUTS  # the probe's model invented a name a turn: ~41 KB each, kept
    assert f"invented_{3 * MAX_LAYOUTS - 1}" in template._layouts and "calc" not in template._layouts
    assert template.suffix("7", "calc", after_stop=False) == first  # measured again, the same

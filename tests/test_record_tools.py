"""A dataset record's own tools and messages reach the model, its calls to them are read (several in a turn), and a
built-in task's declared tools never leak into a dataset's episodes."""

from __future__ import annotations

import json

import pytest
from test_protocols import chat_dirs, rollout, tok  # noqa: F401  the chat-model fixtures

from mrl.chat.protocols import ChatProtocol, Tool, split_calls
from mrl.core.config import UserError
from mrl.core.data import DatasetTask, record_messages, record_tools, records_to_prompts
from mrl.core.episode import Prompt, ToolCall
from mrl.envs.calc_agent import CalcAgent
from mrl.envs.task import DatasetPrompts
from mrl.envs.tool_call import ToolCallTask

WEATHER = {"name": "get_weather", "description": "Weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "description": "Time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALC = {"calc": Tool("calc", "Adds.", {"type": "object", "properties": {}}, fn=lambda p, a: "7")}


def record_prompt(*tools: dict, **fields) -> Prompt:
    (prompt,) = records_to_prompts([{"messages": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Weather and time in Oslo?"}],
                                     "tools": list(tools), **fields}])
    return prompt


def call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_a_record_carries_its_messages_and_tools_into_the_prompt():
    prompt = record_prompt(WEATHER, {"type": "function", "function": TIME}, id="r1")
    assert prompt.text == "Weather and time in Oslo?"  # no `prompt` field: the last user turn
    assert [m["role"] for m in prompt.messages] == ["system", "user"] and prompt.meta == {"id": "r1"}
    assert prompt.tools == [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
    short = record_tools({"calc": ["a", "b"]}, "record 0")[0]["function"]
    assert short == {"name": "calc", "description": "", "parameters": {
        "type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"]}}


@pytest.mark.parametrize("messages, says", [
    ([], "non-empty list"), ([{"role": "robot", "content": "x"}], r"messages\[0\] = .* is not a turn"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "must end with the user's turn")])
def test_bad_messages_are_one_line_naming_the_record(messages, says):
    with pytest.raises(UserError, match=says):
        record_messages(messages, "record 3")


@pytest.mark.parametrize("tools", [[{"description": "no name"}], "calc", [{"name": "f", "parameters": [1]}]])
def test_bad_tools_are_one_line(tools):
    with pytest.raises(UserError, match="record 0: `?tools"):
        record_tools(tools, "record 0")


def test_the_records_tools_replace_the_tasks_in_the_prompt_and_the_protocol(tok):  # noqa: F811
    prompt = record_prompt(WEATHER)
    protocol = ChatProtocol(tok, CALC, max_turns=3)
    shown = tok.decode(protocol.prompt_ids(prompt))
    assert "get_weather" in shown and "Adds." not in shown and "Be brief." in shown
    replies = [call("calc"), call("get_weather", city="Oslo")]
    r, _ = rollout(tok, protocol, lambda t: replies[t.count("<tool_response>")], [prompt])
    ep = r.episodes[0]
    assert ep.tool_calls == [ToolCall("calc", {}, "error: there is no tool 'calc'; the tools are: get_weather",
                                      valid=False), ToolCall("get_weather", {"city": "Oslo"})]
    assert not ep.truncated  # the declared tool's call is the answer: the episode ends there
    plain = Prompt("3 + 4?")  # a prompt without tools of its own keeps the task's
    assert "Adds." in tok.decode(protocol.prompt_ids(plain))


def test_parallel_calls_are_all_read_from_one_turn(tok):  # noqa: F811
    protocol = ChatProtocol(tok, {}, parallel_calls=True)
    reply = "Both." + call("get_weather", city="Oslo") + "\n" + call("get_time", city="Oslo") + call("nope") \
        + "<|im_end|>"
    r, _ = rollout(tok, protocol, lambda t: reply, [record_prompt(WEATHER, TIME)])
    ep = r.episodes[0]
    assert [(c.name, c.arguments, c.valid) for c in ep.tool_calls] == [
        ("get_weather", {"city": "Oslo"}, True), ("get_time", {"city": "Oslo"}, True), ("nope", {}, False)]
    assert ep.turns == ["Both."] and ep.observation_tokens == 0 and not ep.truncated
    cut, _ = rollout(tok, protocol, lambda t: reply, [record_prompt(WEATHER, TIME)], max_new=12)
    assert cut.episodes[0].tool_calls == [] and cut.episodes[0].truncated  # out of budget mid-call: no answer
    with pytest.raises(UserError, match="tools that never run"):
        ChatProtocol(tok, CALC, parallel_calls=True)


def test_split_calls_reads_every_block():
    assert split_calls("no call") == ("no call", [])
    assert split_calls('x<tool_call>{"a": 1}</tool_call> y <tool_call>{"b"') == ("x", ['{"a": 1}', '{"b"'])
    assert split_calls('<think>hm</think><tool_call>1</tool_call><tool_call>2</tool_call>') == ("", ["1", "2"])


def test_built_in_declared_tools_never_reach_a_datasets_episodes(tmp_path, tok):  # noqa: F811
    data = tmp_path / "calls.jsonl"
    data.write_text(json.dumps({"prompt": "Weather in Oslo?", "call": {"name": "get_weather",
                                                                       "arguments": {"city": "Oslo"}}}) + "\n"
                    + json.dumps({"prompt": "Weather?", "call": {"name": "get_weather", "arguments": {}},
                                  "tools": [WEATHER]}) + "\n")
    task = DatasetPrompts(ToolCallTask(), DatasetTask(str(data), eval_fraction=0))
    assert task.tools == {}  # calc and lookup are the built-in generator's answers
    declared = sorted(task.prompt(i).tools[0]["function"]["name"] for i in range(2))
    assert declared == ["get_weather", "get_weather"]  # the called tool alone, or the record's own
    shown = tok.decode(ChatProtocol(tok, task.tools).prompt_ids(task.prompt(0)))
    assert "get_weather" in shown and "lookup" not in shown and '"calc"' not in shown
    environment = DatasetPrompts(CalcAgent(), DatasetTask(str(data), eval_fraction=0))
    assert list(environment.tools) == ["calc"]  # a tool that runs is the environment: it stays


def test_an_answer_prefix_is_part_of_the_prompt_and_the_start_of_the_turn(tok):  # noqa: F811
    from dataclasses import replace

    prompt = replace(record_prompt(WEATHER), answer_prefix='<tool_call>{"name": "')
    protocol = ChatProtocol(tok, {}, parallel_calls=True)
    assert tok.decode(protocol.prompt_ids(prompt)).endswith('<|im_start|>assistant\n<tool_call>{"name": "')
    r, _ = rollout(tok, protocol, lambda t: 'get_weather", "arguments": {"city": "Oslo"}}</tool_call><|im_end|>',
                   [prompt])
    ep = r.episodes[0]
    assert ep.tool_calls == [ToolCall("get_weather", {"city": "Oslo"})] and not ep.truncated
    assert ep.completion.startswith('get_weather"')  # the prefix is the prompt's: never trained on
    with pytest.raises(UserError, match="one-turn task"):
        ChatProtocol(tok, {}).prompt_ids(prompt)

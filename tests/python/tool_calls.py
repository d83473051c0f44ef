"""Tool calling through the real OpenAI client library against a running Ferry.

Usage: tool_calls.py BASE_URL   (e.g. http://127.0.0.1:8000/v1)

Each check prints one line; any failure raises (non-zero exit). The last line is a summary
the Rust test reads.
"""
import json
import sys

import jsonschema
import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base, api_key="unused")
MODEL = "SmolLM2-135M-Instruct"

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def create(**kwargs):
    args = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=96)
    args.update(kwargs)
    return client.chat.completions.create(**args)


def valid(call):
    """A call's name is a tool's and its arguments parse and follow that tool's schema."""
    assert call.type == "function", call
    assert call.id, call
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return (call.function.name, args)


def streamed(**kwargs):
    """The calls of a streamed answer, reassembled from their deltas by index, its content
    and finish reason."""
    calls, content, finish = {}, "", None
    for chunk in create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += d.id or ""
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], content, finish


# 1. tool_choice required: one call that parses and follows its tool's schema, for 10 seeds
#    at temperature 1.
for seed in range(10):
    r = create(tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", (seed, choice)
    assert choice.message.content is None, (seed, choice.message)
    assert len(choice.message.tool_calls) == 1, (seed, choice.message)
    valid(choice.message.tool_calls[0])
print(f"required: 10 of 10 calls valid; e.g. {valid(choice.message.tool_calls[0])}")

# 2. Parallel calls (the default): every call given back is valid.
r = create(tool_choice="required", temperature=1.0, seed=3, max_tokens=200)
calls = r.choices[0].message.tool_calls
assert calls, r
names = [valid(c)[0] for c in calls]
print(f"required, parallel: {len(calls)} valid calls {names} ({r.choices[0].finish_reason})")

# 3. A named function: a call to it, finish reason stop (as OpenAI's).
named = {"type": "function", "function": {"name": "get_time"}}
r = create(tool_choice=named, temperature=1.0, seed=7)
choice = r.choices[0]
assert choice.finish_reason == "stop", choice
assert [c.function.name for c in choice.message.tool_calls] == ["get_time"], choice.message
named_call = valid(choice.message.tool_calls[0])
print(f"named: {named_call}")

# 4. A streamed call reassembles into the same call as the unstreamed answer.
for kwargs in [dict(tool_choice="required", parallel_tool_calls=False), dict(tool_choice=named)]:
    whole = create(temperature=1.0, seed=11, **kwargs).choices[0]
    calls, content, finish = streamed(temperature=1.0, seed=11, **kwargs)
    want = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [(c["name"], c["arguments"]) for c in calls] == want, (calls, want)
    assert all(c["id"] for c in calls), calls
    assert content == "" and finish == whole.finish_reason, (content, finish, whole)
print(f"streamed: reassembled calls equal the unstreamed ones; e.g. {want}")

# 5. Auto: a call the model writes is read into tool_calls, streamed or not. The model is
#    steered with a grammar to write one, so that the check does not depend on its judgement.
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
steer = {"structured_outputs": {"regex": "Let me check\\.\n" + CALL.replace("{", "\\{").replace("}", "\\}")}}
r = create(tool_choice="auto", temperature=0, extra_body=steer)
choice = r.choices[0]
assert choice.finish_reason == "tool_calls", choice
assert choice.message.content == "Let me check.", choice.message
assert [valid(c) for c in choice.message.tool_calls] == [("get_time", {"tz": "CET"})], choice.message
calls, content, finish = streamed(tool_choice="auto", temperature=0, extra_body=steer)
assert content == "Let me check." and finish == "tool_calls", (content, finish)
assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_time", {"tz": "CET"})], calls
# Without tools the same text is plain content.
r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=96, temperature=0, extra_body=steer)
assert r.choices[0].message.content.endswith("</tool_call>") and not r.choices[0].message.tool_calls, r
# tool_choice none: the tools are shown to the model but no call is read.
r = create(tool_choice="none", temperature=0, extra_body=steer)
assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls, r
print("auto: a written call is read, streamed or not; without tools or with none it stays text")

# 6. The tools and a conversation with calls and answers reach the prompt.
plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1).usage.prompt_tokens
with_tools = create(max_tokens=1).usage.prompt_tokens
assert with_tools > plain + 50, (plain, with_tools)
call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
history = MESSAGES + [
    {"role": "assistant", "content": None, "tool_calls": [call]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
]
r = create(messages=history, temperature=0, max_tokens=48)
assert r.usage.prompt_tokens > with_tools + 20, (with_tools, r.usage)
assert r.choices[0].finish_reason in ("stop", "length", "tool_calls"), r
print(f"history: prompt {plain} tokens, {with_tools} with tools, {r.usage.prompt_tokens} with a call and its answer")

# 7. Names, a continued last message and template variables.
named_user = [{"role": "user", "content": "Hi there", "name": "ann"}]
a = client.chat.completions.create(model=MODEL, messages=named_user, max_tokens=1).usage.prompt_tokens
b = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=1).usage.prompt_tokens
assert a > b, (a, b)
cont = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "The capital of France is"}]
r = client.chat.completions.create(model=MODEL, messages=cont, max_tokens=8, temperature=0,
                                   extra_body={"continue_final_message": True, "add_generation_prompt": False})
assert "Paris" in r.choices[0].message.content, r
r2 = client.chat.completions.create(model=MODEL, messages=cont, max_tokens=8, temperature=0,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
assert r2.choices[0].message.content, r2
print(f"names, continue_final_message ({r.choices[0].message.content!r}), chat_template_kwargs: ok")


# 8. Bad requests are 400s that say why.
def refused(needle, **kwargs):
    try:
        create(**kwargs)
    except openai.BadRequestError as e:
        assert needle in str(e), (needle, str(e))
        return
    raise AssertionError(f"not refused: {kwargs}")


refused("not in tools", tool_choice={"type": "function", "function": {"name": "nope"}})
refused("`tools` must be set", tools=None, tool_choice="required")
refused("must be 1 to 64 letters", tools=[{"type": "function", "function": {"name": "a b"}}])
refused("tools[0].type must be \"function\"", tools=[{"type": "code_interpreter"}])
refused("cannot be combined with a structured output", tool_choice="required", response_format={"type": "json_object"})
refused("tool_choice = ", tool_choice="sometimes")
refused("tool_calls is only for assistant messages", messages=[{"role": "user", "content": "x", "tool_calls": [call]}])
bad_call = dict(call, function={"name": "get_weather", "arguments": "{city"})
refused("arguments is not JSON", messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [bad_call]}])
refused("Cannot set both `continue_final_message` and `add_generation_prompt` to True", extra_body={"continue_final_message": True})
refused("chat_template_kwargs may not set", extra_body={"chat_template_kwargs": {"messages": []}})
refused("deprecated", messages=[{"role": "function", "name": "f", "content": "x"}])
print("400s: unknown function, no tools, bad names and types, two constraints, bad history")
print("tool calls: ok")

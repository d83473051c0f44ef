"""Structured outputs through the real OpenAI client library against a running Ferry.

Usage: structured_outputs.py BASE_URL   (e.g. http://127.0.0.1:8000/v1)

Each check prints one line; any failure raises (non-zero exit). The last line is a summary
the Rust test reads.
"""
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base, api_key="unused")
MODEL = "SmolLM2-135M-Instruct"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "tags", "active"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person who lives in a big city, as JSON."}]
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}


def person(seed):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=160,
        response_format=RESPONSE_FORMAT,
    )
    choice = r.choices[0]
    text = choice.message.content
    assert choice.finish_reason == "stop", (seed, choice.finish_reason, text)
    value = json.loads(text)
    jsonschema.validate(value, PERSON)
    return text


# 1. A json_schema response parses and validates for 20 seeds at temperature 1.
with ThreadPoolExecutor(max_workers=8) as pool:
    texts = list(pool.map(person, range(20)))
distinct = len(set(texts))
assert distinct >= 10, f"only {distinct} distinct outputs over 20 seeds: {texts}"
print(f"json_schema: 20 of 20 valid, {distinct} distinct; e.g. {texts[0]}")

# 2. The same seed streamed gives the same text.
stream = client.chat.completions.create(
    model=MODEL, messages=MESSAGES, temperature=1.0, seed=0, max_tokens=160,
    response_format=RESPONSE_FORMAT, stream=True,
)
streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
assert streamed == texts[0], (streamed, texts[0])
print("streamed: equal to the unstreamed answer")

# 3. json_object: any JSON object.
r = client.chat.completions.create(
    model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
    temperature=0.8, seed=3, max_tokens=200, response_format={"type": "json_object"},
)
if r.choices[0].finish_reason == "stop":
    assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content
    print(f"json_object: {r.choices[0].message.content}")
else:
    # Cut by max_tokens: the prefix must still be a JSON object's beginning.
    assert r.choices[0].message.content.startswith("{"), r.choices[0].message.content
    print("json_object: cut by max_tokens, starts as an object")

# 4. vLLM's extensions through extra_body: choice, regex, grammar, structured_outputs.
def chat(extra, content="What is the capital of France?", temperature=0.0):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}],
        temperature=temperature, max_tokens=24, extra_body=extra,
    )
    return r.choices[0].message.content

city = chat({"guided_choice": ["London", "Paris", "Rome"]})
assert city in ("London", "Paris", "Rome"), city
assert chat({"structured_outputs": {"choice": ["yes", "no"]}}, "Is Paris in France?") in ("yes", "no")
phone = chat({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, "Tell me a story.", 1.0)
assert len(phone) == 8 and phone[3] == "-" and (phone[:3] + phone[4:]).isdigit(), phone
lark = chat({"guided_grammar": 'start: "The answer is " ("yes" | "no") "."'}, "Is it raining?")
assert lark in ("The answer is yes.", "The answer is no."), lark
value = json.loads(chat({"guided_json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}}, "Some numbers?"))
assert isinstance(value, list) and all(isinstance(v, int) for v in value), value
print(f"vLLM fields: choice {city!r}, regex {phone!r}, grammar {lark!r}, guided_json {value}")

# 5. Bad constraints are 400s that say what is wrong.
def refused(**kwargs):
    try:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **kwargs)
    except openai.BadRequestError as e:
        return str(e)
    raise AssertionError(f"accepted: {kwargs}")

bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
assert "structured output" in refused(response_format=bad_schema)
assert "structured output" in refused(extra_body={"guided_regex": "("})
assert "only use one kind" in refused(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"})
print("refused: bad schema, bad regex, two constraints")
print("structured outputs: ok")

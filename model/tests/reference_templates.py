#!/usr/bin/env python3
"""The reference for Ferry's chat templates: each family's published template
(`templates/*.jinja`, as llama.cpp keeps them from the model cards) rendered by Jinja2 the way
Hugging Face's `transformers` renders a chat template (`_compile_jinja_template`: a sandboxed
environment with `trim_blocks`, `lstrip_blocks` and loop controls; its `tojson` filter,
`raise_exception` and `strftime_now`), with the clock fixed at NOW, for a set of conversations.

    reference_templates.py OUT.json BOS EOS

writes {"now": "...", "cases": [{"template": file, "conversation": name, "messages": [...],
"tools": [...], "add_generation_prompt": bool, "text": str | null, "error": str | null}]}.
"""
import glob
import json
import os
import sys
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

NOW = datetime(2026, 12, 5, 13, 45, 7)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city <now> & 'later'",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "Where, e.g. \"Paris\""},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    }
]

CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "What is the capital of France?"}],
    "with a system prompt": [
        {"role": "system", "content": "You are terse.\nAnswer in one word."},
        {"role": "user", "content": "  Capital of France?  "},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Japan? 日本 — ünïcödé"},
    ],
    "a tool call": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "abc123xyz",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "abc123xyz", "name": "get_weather", "content": "{\"temp\": 21}"},
    ],
}


def environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return NOW.strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def main():
    out, bos, eos = sys.argv[1], sys.argv[2], sys.argv[3]
    here = os.path.dirname(os.path.abspath(__file__))
    env = environment()
    cases = []
    for path in sorted(glob.glob(f"{here}/templates/*.jinja")):
        source = open(path, encoding="utf-8").read()
        template = env.from_string(source)
        uses_tools = "tools" in source
        for name, messages in CONVERSATIONS.items():
            tools = TOOLS if uses_tools else []
            if name == "a tool call" and not uses_tools:
                continue
            for add_generation_prompt in (True, False):
                case = {"template": os.path.basename(path), "conversation": name,
                        "messages": messages, "tools": tools,
                        "add_generation_prompt": add_generation_prompt, "text": None, "error": None}
                kwargs = {"tools": tools} if tools else {}
                try:
                    case["text"] = template.render(messages=messages, bos_token=bos, eos_token=eos,
                                                   add_generation_prompt=add_generation_prompt,
                                                   **kwargs)
                except jinja2.exceptions.TemplateError as e:
                    case["error"] = str(e)
                cases.append(case)
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"now": NOW.isoformat(), "cases": cases}, f, ensure_ascii=False)


if __name__ == "__main__":
    main()

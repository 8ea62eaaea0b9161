"""End-to-end check of a running q4moe server with the official `openai` client.

Usage: python e2e.py [--base-url http://127.0.0.1:8080/v1] [--api-key K] [--model q4moe]
Exits non-zero on the first failed check.
"""
import argparse
import sys

import openai


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default="q4moe")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key=a.api_key)

    models = client.models.list()
    assert any(m.id == a.model for m in models.data), models
    print("models:", [m.id for m in models.data])

    msgs = [{"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model=a.model, messages=msgs, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].finish_reason in ("stop", "length"), r
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r.usage
    print("chat:", repr(r.choices[0].message.content), r.usage)

    stream = client.chat.completions.create(
        model=a.model, messages=msgs, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text == r.choices[0].message.content, (text, r.choices[0].message.content)
    assert usage is not None and finish in ("stop", "length"), (usage, finish)
    print("chat stream:", repr(text), usage)

    # A second turn: its prompt extends the first's, so the server reuses that KV.
    msgs2 = msgs + [{"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": "Again, /no_think"}]
    r2 = client.chat.completions.create(model=a.model, messages=msgs2, max_tokens=8, temperature=0,
                                        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1})
    print("chat turn 2:", repr(r2.choices[0].message.content), r2.usage)

    c = client.completions.create(model=a.model, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert c.object == "text_completion", c
    print("completion:", repr(c.choices[0].text), c.usage)
    text = "".join(ch.choices[0].text for ch in client.completions.create(
        model=a.model, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True) if ch.choices)
    assert text == c.choices[0].text, (text, c.choices[0].text)
    print("completion stream:", repr(text))

    features(client, a.model, msgs)
    legacy(client, a.model)

    try:
        client.chat.completions.create(model=a.model, messages=[], max_tokens=4)
        raise AssertionError("empty messages accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "messages", e.body
        print("bad request:", e.body["message"])
    try:
        client.chat.completions.create(model="no-such-model", messages=msgs, max_tokens=4)
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError as e:
        print("unknown model:", e.body["message"])
    print("all checks passed")
    return 0


def features(client, model, msgs):
    """logprobs, n, logit_bias, echo, several prompts, json_schema and a required tool call,
    through the official client's own types (so its parsing of our shapes is checked too)."""
    import json
    import math

    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    assert lp and all(math.isfinite(t.logprob) and t.logprob <= 0 for t in lp), lp
    for t in lp:  # greedy: the chosen token is the most likely one
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob, t
    text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=model, messages=msgs, max_tokens=6, temperature=0, logprobs=True, stream=True)
        if ch.choices)
    assert text == r.choices[0].message.content, (text, r.choices[0].message.content)
    print("logprobs:", [(t.token, round(t.logprob, 3)) for t in lp[:3]])

    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2], r.choices
    assert len({c.message.content for c in r.choices}) == 1, "greedy choices differ"
    print("n=3:", r.usage)

    first = client.completions.create(model=model, prompt="Once upon a time", max_tokens=1,
                                      temperature=0, logprobs=1)
    tok = first.choices[0].logprobs.tokens[0]
    ids = client.post("/../tokenize", body={"content": tok}, cast_to=object)["tokens"]
    if len(ids) == 1:
        biased = client.completions.create(model=model, prompt="Once upon a time", max_tokens=1,
                                           temperature=0, logit_bias={str(ids[0]): -100})
        assert biased.choices[0].text != first.choices[0].text, "logit_bias -100 kept the token"
        print("logit_bias: moved", repr(first.choices[0].text), "->", repr(biased.choices[0].text))

    c = client.completions.create(model=model, prompt=["One", "Two"], max_tokens=3, temperature=0,
                                  echo=True)
    assert [ch.text[:3] for ch in sorted(c.choices, key=lambda x: x.index)] == ["One", "Two"], c
    print("two prompts with echo:", [ch.text for ch in c.choices])

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A person as JSON."}], max_tokens=64,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "person", "schema": schema,
                                                        "strict": True}})
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int), obj
    print("json_schema:", obj)

    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                       "required": ["city"], "additionalProperties": False}}}]
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=64,
        temperature=0, tools=tools, tool_choice="required")
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather", r
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"}, args
    print("tool call:", call.id, call.function.name, args)
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model=model, messages=follow, max_tokens=4, temperature=0)
    print("after the tool result:", r.usage)


def legacy(client, model):
    """best_of, suffix (fill-in-the-middle) with echo, /infill, and the legacy functions /
    function_call, whole and streamed, through the client's own types."""
    import json

    many = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5,
                                     temperature=1.0, seed=5, n=3, logprobs=0)
    means = sorted(((sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs), c.text)
                    for c in many.choices), reverse=True)
    best = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5,
                                     temperature=1.0, seed=5, best_of=3)
    assert best.choices[0].text == means[0][1], (best.choices[0].text, means)
    assert best.usage.completion_tokens == many.usage.completion_tokens, (best.usage, many.usage)
    print("best_of=3:", repr(best.choices[0].text), best.usage)
    try:
        client.completions.create(model=model, prompt="x", max_tokens=2, best_of=2, stream=True)
        raise AssertionError("streamed best_of > n accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "best_of", e.body

    prefix, suffix = "def add(a, b):\n", "\n    return c\n"
    mid = client.completions.create(model=model, prompt=prefix, suffix=suffix, max_tokens=6,
                                    temperature=0)
    whole = client.completions.create(model=model, prompt=prefix, suffix=suffix, max_tokens=6,
                                      temperature=0, echo=True)
    assert whole.choices[0].text == prefix + mid.choices[0].text + suffix, whole
    infill = client.post("/../infill", cast_to=object, body={
        "input_prefix": prefix, "input_suffix": suffix, "n_predict": 6, "temperature": 0})
    assert infill["content"] == mid.choices[0].text and infill["stop"], infill
    print("suffix:", repr(mid.choices[0].text), "/infill:", infill["stop_type"])

    functions = [{"name": "get_weather", "description": "Weather in a city",
                  "parameters": {"type": "object",
                                 "properties": {"city": {"type": "string", "maxLength": 16}},
                                 "required": ["city"], "additionalProperties": False}}]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model=model, messages=ask, max_tokens=64, temperature=0,
                                       functions=functions,
                                       function_call={"name": "get_weather"})
    call = r.choices[0].message.function_call
    assert r.choices[0].finish_reason == "function_call" and call.name == "get_weather", r
    assert not r.choices[0].message.tool_calls, r
    args = json.loads(call.arguments)
    assert set(args) == {"city"}, args
    name, arguments = "", ""
    for ch in client.chat.completions.create(model=model, messages=ask, max_tokens=64,
                                             temperature=0, functions=functions,
                                             function_call={"name": "get_weather"}, stream=True):
        for c in ch.choices:
            if c.delta.function_call:
                name += c.delta.function_call.name or ""
                arguments += c.delta.function_call.arguments or ""
    assert (name, arguments) == (call.name, call.arguments), (name, arguments)
    print("function_call:", call.name, args)
    follow = ask + [{"role": "assistant", "content": None,
                     "function_call": {"name": call.name, "arguments": call.arguments}},
                    {"role": "function", "name": call.name, "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model=model, messages=follow, max_tokens=4, temperature=0,
                                       functions=functions)
    print("after the function result:", r.usage)


if __name__ == "__main__":
    sys.exit(main())

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


if __name__ == "__main__":
    sys.exit(main())

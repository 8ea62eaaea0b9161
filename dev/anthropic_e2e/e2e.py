"""End-to-end check of a running q4moe server's /v1/messages with the official `anthropic` client.

Usage: python e2e.py [--base-url http://127.0.0.1:8080] [--api-key K] [--model q4moe]
Exits non-zero on the first failed check.
"""
import argparse
import sys

import anthropic


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8080")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default="q4moe")
    a = ap.parse_args()
    client = anthropic.Anthropic(base_url=a.base_url, api_key=a.api_key, max_retries=0)
    msgs = [{"role": "user", "content": "Say hello."}]
    # Recent clients take no sampling arguments; greedy decoding (for equal texts) goes in the body.
    common = dict(model=a.model, max_tokens=8, system="Be brief.", extra_body={"temperature": 0})

    r = client.messages.create(messages=msgs, **common)
    assert r.type == "message" and r.role == "assistant", r
    assert r.content[-1].type == "text" and r.stop_reason in ("end_turn", "max_tokens"), r
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 8, r.usage
    print("message:", repr(text_of(r)), r.stop_reason, r.usage)

    with client.messages.stream(messages=msgs, **common) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(r) == text_of(final), (streamed, text_of(r), text_of(final))
    assert final.stop_reason == r.stop_reason and final.usage.output_tokens == r.usage.output_tokens, final
    print("stream:", repr(streamed), final.stop_reason, final.usage)

    n = client.messages.count_tokens(model=a.model, messages=msgs, system="Be brief.")
    assert n.input_tokens == r.usage.input_tokens, (n, r.usage)
    print("count_tokens:", n.input_tokens)

    text = text_of(r)
    if len(text) >= 4:
        stop = text[len(text) // 2:][:2]
        s = client.messages.create(messages=msgs, stop_sequences=[stop], **common)
        assert s.stop_reason == "stop_sequence" and s.stop_sequence == stop, s
        assert text_of(s) == text[: text.find(stop)], (text_of(s), text, stop)
        print("stop_sequence:", repr(stop), repr(text_of(s)))

    tools_turns = msgs + [
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "UTC"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"}]},
    ]
    t = client.messages.create(messages=tools_turns, **common)
    assert t.usage.input_tokens > r.usage.input_tokens, (t.usage, r.usage)
    print("tool_result turn:", repr(text_of(t)), t.usage)

    try:
        client.messages.create(model=a.model, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}])
        raise AssertionError("an image block was accepted")
    except anthropic.BadRequestError as e:
        assert e.body["type"] == "error" and e.body["error"]["type"] == "invalid_request_error", e.body
        print("image refused:", e.body["error"]["message"])
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

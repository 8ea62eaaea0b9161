#!/usr/bin/env python3
"""Tokenizer parity fixture: Hugging Face transformers is the oracle for q4moe-tokenizer.

1. Gets `synthetic_spec(N, SEED)` from the Rust `dump_spec` example (or --spec spec.json).
2. Writes a GGUF holding only tokenizer metadata (general.architecture = qwen3moe).
3. Loads it with `AutoTokenizer.from_pretrained(dir, gguf_file=...)` (transformers' GGUF loader).
4. Encodes/decodes the strings below and writes tests/fixtures/tokenizer/parity_<N>.json.
The Rust test `tests/parity.rs` rebuilds the same spec and compares ids and text for every string.
"""
import argparse, json, os, random, subprocess, sys, tempfile

import gguf

FIXTURE_VERSION = 1
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def load_spec(n, seed, spec_path):
    if spec_path:
        return json.load(open(spec_path))
    cmd = ["cargo", "run", "-q", "--release", "-p", "q4moe-tokenizer", "--example", "dump_spec", "--", str(n), str(seed)]
    return json.loads(subprocess.check_output(cmd, cwd=REPO))


def write_gguf(spec, path):
    w = gguf.GGUFWriter(path, "qwen3moe")  # also writes general.architecture
    w.add_name("q4moe tokenizer parity fixture")
    w.add_vocab_size(len(spec["tokens"]))
    w.add_tokenizer_model(spec["model"])
    w.add_tokenizer_pre(spec["pre"])
    w.add_token_list(spec["tokens"])
    w.add_token_types(spec["token_types"])
    w.add_token_merges(spec["merges"])
    if spec["bos_id"] is not None:
        w.add_bos_token_id(spec["bos_id"])
    w.add_eos_token_id(spec["eos_id"])
    if spec["pad_id"] is not None:
        w.add_pad_token_id(spec["pad_id"])
    w.add_add_bos_token(spec["add_bos"])
    if spec["chat_template"]:
        w.add_chat_template(spec["chat_template"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_strings(seed):
    fixed = [
        "", " ", "  ", "\n", "\t", "\r\n", "Hello", "Hello world", " Hello world", "Hello  world",
        "The quick brown fox jumps over the lazy dog.", "THE QUICK BROWN FOX", "I'm sure they're done; we've won, you'll see, he'd go.",
        "I'M SURE THEY'RE", "don't", "DON'T", "12345", "3.14159", "1,000,000", "2024-05-17 10:30:00", "0x7fff", "1e-6",
        "a1b2c3", "Version 2.0.1-rc3", "$100.00", "50%", "   leading spaces", "trailing spaces   ", "tabs\tand\ttabs",
        "line1\nline2\n\nline4", "\n\n\n", " \n \n ", "mixed \t \n whitespace \r\n end", "    indented\n        more",
        "café", "naïve résumé", "Ça va? Où est la bibliothèque?", "Der Bär läuft über die Straße.", "e\u0301 composed vs \u00e9",
        "人工智能是计算机科学的一个分支。", "你好，世界！", "こんにちは、世界。", "안녕하세요 세계", "Привет, мир!", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया",
        "😀", "🎉👍🚀", "❤️", "👨‍👩‍👧‍👦 family", "🇫🇷 flag", "emoji 😀 in text 🎉!", "Ω≈ç√∫", "ℝ ⊂ ℂ", "\u200b zero width", "\u00a0nbsp",
        "fn main() {\n    println!(\"Hello, world!\");\n}\n", "def f(x):\n\treturn x ** 2\n", "if (a && b || !c) { x += 1; }",
        "SELECT * FROM users WHERE id = 42;", "<div class=\"a\">text</div>", "https://example.com/path?q=1&r=2#frag",
        "user@example.com", "C:\\Users\\name\\file.txt", "a,b;c:d.e!f?g", "((()))[[[]]]{{{}}}", "--->>> <<<---", "#!/usr/bin/env python3",
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", "<|im_start|>system\nYou are helpful.<|im_end|>",
        "<think>\nreasoning here\n</think>\n\nanswer", "<think>\n\n</think>\n\n", "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
        "<tool_response>\nok\n</tool_response>", "<|endoftext|>", "text<|endoftext|>more", "<|im_end|><|im_end|>", "<|im_start|", "<|fim_prefix|>def<|fim_suffix|>x<|fim_middle|>",
        "<think>", "</think>", "a<think>b</think>c", "<|vision_start|><|image_pad|><|vision_end|>", "<|unknown|>", "< think >",
    ]
    rng = random.Random(seed)
    alphabet = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n\t.,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`") + list("éüñçß中文字日本語한국😀🎉ö€£")
    words = ["the", "model", "token", "expert", "number", "language", "The", "is", "and", "of", "information", "going", "self", "return", "think"]
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>"]
    out = list(fixed)
    while len(out) < 260:
        kind = len(out) % 3
        if kind == 0:
            s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        elif kind == 1:
            s = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
            s = s.replace(" ", rng.choice([" ", "  ", "\n", " \n", "\t"]), rng.randint(0, 3))
        else:
            parts = [rng.choice(words + specials + ["\n", " ", "123", "😀", "中文"]) for _ in range(rng.randint(1, 10))]
            s = "".join(parts)
        out.append(s)
    return out


def chat_cases(tok):
    """Qwen3 template renders through transformers' own Jinja environment (apply_chat_template)."""
    user = {"role": "user", "content": "Hello! What is 2+2?"}
    sys_ = {"role": "system", "content": "You are a helpful assistant."}
    convs = [
        ([user], True, None), ([user], True, False), ([user], True, True), ([user], False, None),
        ([sys_, user, {"role": "assistant", "content": "It is 4."}, {"role": "user", "content": "And 3+3?"}], True, None),
        ([sys_, user, {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 4."},
          {"role": "user", "content": "Thanks"}], True, False),
        ([user, {"role": "assistant", "content": "It is 4.", "reasoning_content": "2 plus 2"}], False, None),
        ([user, {"role": "assistant", "content": "<think>\nsimple\n</think>\n\n4"}], False, None),
        ([sys_, user, {"role": "assistant", "content": "checking"}, {"role": "tool", "content": "{\"ok\": true}"},
          {"role": "tool", "content": "second"}], True, None),
        ([{"role": "user", "content": "中文 😀 <think> in text"}], True, None),
    ]
    out = []
    for messages, gen, thinking in convs:
        kwargs = {} if thinking is None else {"enable_thinking": thinking}
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kwargs)
        ids = tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
        out.append({"messages": messages, "add_generation_prompt": gen, "enable_thinking": thinking, "rendered": text, "ids": ids})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spec", help="spec JSON from dump_spec (skips cargo)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer
    import transformers

    spec = load_spec(args.vocab_size, args.seed, args.spec)
    assert len(spec["tokens"]) == args.vocab_size, "spec size differs from --vocab-size"
    with tempfile.TemporaryDirectory() as d:
        write_gguf(spec, os.path.join(d, "tok.gguf"))
        tok = AutoTokenizer.from_pretrained(d, gguf_file="tok.gguf")
    backend = tok.backend_tokenizer
    cases = []
    for s in test_strings(args.seed):
        ids = backend.encode(s, add_special_tokens=False).ids
        backend.encode_special_tokens = True
        ids_plain = backend.encode(s, add_special_tokens=False).ids
        backend.encode_special_tokens = False
        cases.append({
            "text": s,
            "ids": ids,
            "ids_no_special": ids_plain,
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
        })
    fixture = {
        "version": FIXTURE_VERSION,
        "vocab_size": args.vocab_size,
        "seed": args.seed,
        "oracle": f"transformers {transformers.__version__} ({type(tok).__name__}) via gguf {getattr(gguf, '__version__', '?')}",
        "cases": cases,
        "chat": chat_cases(tok),
    }
    out = args.out or os.path.join(REPO, "tests", "fixtures", "tokenizer", f"parity_{args.vocab_size}_seed{args.seed}.json")
    with open(out, "w") as f:
        json.dump(fixture, f, ensure_ascii=False, indent=0)
    print(f"wrote {out}: {len(cases)} cases, {type(tok).__name__}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""A small byte-level BPE tokenizer in Qwen3's layout, written as llama.cpp's converter writes a
Qwen3 tokenizer: the 256 byte tokens (GPT-2's byte-to-unicode mapping), merged tokens in merge
order (trained here on TEXT), the control tokens, then `[PADn]` (type UNUSED) up to the
embedding's rows. Made here rather than taken from q4moe so the files owe nothing to q4moe."""
import re
from collections import Counter

import gguf

TEXT = """The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to
the few experts its router scores highest, then adds their outputs weighted by the scores.
fn main() { let x = vec![1, 2, 3]; for v in x.iter() { println!("{v}"); } }
def forward(self, x): return self.down(self.act(self.gate(x)) * self.up(x))
the the the and and of of to to in in is is that that it it for for with with as as on on"""
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PADDING = 4  # rows past the tokenizer's tokens, as real files pad the embedding


def bytes_to_unicode() -> list:
    """GPT-2's printable stand-in for each byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def train(n_merges: int) -> list:
    """Plain BPE over TEXT's words (a leading space kept with its word); ties broken by the
    pair's text so the result is deterministic."""
    table = bytes_to_unicode()
    words = Counter(tuple(table[b] for b in w.encode()) for w in re.findall(r" ?\S+|\s+", TEXT))
    merges = []
    while len(merges) < n_merges:
        pairs = Counter()
        for w, n in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = Counter()
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return merges


def add_tokenizer(w: gguf.GGUFWriter, n_vocab: int) -> None:
    n_merges = n_vocab - 256 - len(SPECIALS) - PADDING
    if n_merges < 0:
        raise ValueError(f"vocab {n_vocab} leaves no room for the byte and control tokens")
    merges = train(n_merges)
    tokens = bytes_to_unicode() + [a + b for a, b in merges]
    types = [gguf.TokenType.NORMAL] * len(tokens)
    first_special = len(tokens)
    tokens += SPECIALS
    types += [gguf.TokenType.CONTROL] * len(SPECIALS)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]
    types += [gguf.TokenType.UNUSED] * (n_vocab - len(types))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_eos_token_id(first_special + 2)
    w.add_pad_token_id(first_special)
    w.add_bos_token_id(first_special)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

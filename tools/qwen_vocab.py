#!/usr/bin/env python3
"""Qwen's real byte-level BPE vocabulary as a q4moe fixture, checked against tiktoken and HF tokenizers.

1. Reads `qwen.tiktoken` (151,643 ranked tokens), which the `dashscope` wheel on PyPI ships
   (`pip download dashscope --no-deps`; or pass --tiktoken PATH).
2. Derives the BPE merges from the ranks (each multi-byte token is the one merge that BPE limited
   to lower ranks ends with, as transformers' TikTokenConverter does), adds Qwen3's 26 added tokens
   and [PADn] padding up to 151,936, and writes tests/fixtures/qwen_vocab/qwen3_vocab.gguf: Qwen3's
   tokenizer metadata and chat template, plus a micro random model (1 layer, 32 wide) so that the
   file also loads as a model.
3. Assembles a corpus of at least 1 MB: this repository's source files, prose in many scripts
   (the gettext catalogs under /usr/share/locale, plus built-in sentences), emoji sequences,
   whitespace runs, and chat-formatted text with special tokens.
4. Encodes every document with tiktoken and with a Hugging Face `tokenizers` BPE built from the
   same tokens and merges; requires identical ids and an exact decode round trip, and writes
   tests/fixtures/qwen_vocab/expected.json for crates/fuzz/tests/qwen_vocab.rs, which requires
   q4moe's tokenizer to produce the same ids and text.

Generated files are large (about 11 MB and 8 MB) and stay out of git. Needs: tiktoken, tokenizers,
gguf, numpy (`pip install tiktoken tokenizers gguf numpy`).
"""
import argparse, base64, collections, glob, gettext, hashlib, json, os, random, subprocess, sys, tempfile, time, zipfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
OUT = os.path.join(REPO, "tests", "fixtures", "qwen_vocab")
FIXTURE_VERSION = 1
# Qwen's split regex (Qwen1 tiktoken PAT_STR = llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2).
PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
N_BPE = 151_643
VOCAB_SIZE = 151_936
# Qwen3's added tokens in id order, with llama.cpp's token type (3 control, 4 user-defined); the
# same list as q4moe_tokenizer::QWEN3_ADDED_TOKENS.
ADDED = [
    ("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<|object_ref_start|>", 3),
    ("<|object_ref_end|>", 3), ("<|box_start|>", 3), ("<|box_end|>", 3), ("<|quad_start|>", 3),
    ("<|quad_end|>", 3), ("<|vision_start|>", 3), ("<|vision_end|>", 3), ("<|vision_pad|>", 3),
    ("<|image_pad|>", 3), ("<|video_pad|>", 3), ("<tool_call>", 4), ("</tool_call>", 4),
    ("<|fim_prefix|>", 3), ("<|fim_middle|>", 3), ("<|fim_suffix|>", 3), ("<|fim_pad|>", 3),
    ("<|repo_name|>", 3), ("<|file_sep|>", 3), ("<tool_response>", 4), ("</tool_response>", 4),
    ("<think>", 4), ("</think>", 4),
]


def byte_alphabet():
    """GPT-2's bytes_to_unicode."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_CHAR = byte_alphabet()


def spell(bs):
    return "".join(BYTE_CHAR[b] for b in bs)


def fetch_tiktoken(cache):
    """qwen.tiktoken from the dashscope wheel (downloaded once into `cache`)."""
    os.makedirs(cache, exist_ok=True)
    wheels = glob.glob(os.path.join(cache, "dashscope-*.whl"))
    if not wheels:
        subprocess.check_call([sys.executable, "-m", "pip", "download", "dashscope", "--no-deps", "-q", "-d", cache])
        wheels = glob.glob(os.path.join(cache, "dashscope-*.whl"))
    with zipfile.ZipFile(sorted(wheels)[-1]) as z:
        name = next(n for n in z.namelist() if n.endswith("qwen.tiktoken"))
        return z.read(name), os.path.basename(sorted(wheels)[-1])


def load_ranks(data):
    ranks = {}
    for line in data.splitlines():
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    assert sorted(ranks.values()) == list(range(len(ranks))), "ranks are not 0..n-1"
    assert len(ranks) == N_BPE, f"{len(ranks)} ranked tokens, expected {N_BPE}"
    assert all(bytes([b]) in ranks for b in range(256)), "a single byte has no rank"
    return ranks


def bpe_parts(ranks, token, max_rank):
    """BPE of `token`'s bytes using only merges ranked below `max_rank`."""
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best[1]):
                best = (i, r)
        if best is None:
            return parts
        i = best[0]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def merges_from_ranks(ranks):
    """One merge per multi-byte token, in rank order; tokens no merge reaches are reported."""
    merges, unreachable = [], []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = bpe_parts(ranks, token, rank)
        if len(parts) == 2:
            merges.append(spell(parts[0]) + " " + spell(parts[1]))
        else:
            unreachable.append(rank)
    return merges, unreachable


def vocabulary(ranks):
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    tokens = [spell(t) for t, _ in by_rank] + [t for t, _ in ADDED]
    types = [1] * len(by_rank) + [ty for _, ty in ADDED]
    while len(tokens) < VOCAB_SIZE:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(5)
    return tokens, types


def write_gguf(path, tokens, types, merges, template):
    import gguf
    import numpy as np

    d, n_head, n_kv, head_dim, n_exp, n_used, d_ff = 32, 2, 1, 16, 4, 2, 32
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_name("q4moe Qwen3 vocabulary fixture (micro random model)")
    w.add_context_length(256)
    w.add_embedding_length(d)
    w.add_block_count(1)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_expert_count(n_exp)
    w.add_expert_used_count(n_used)
    w.add_expert_feed_forward_length(d_ff)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(151643)
    w.add_eos_token_id(151645)
    w.add_pad_token_id(151643)
    w.add_add_bos_token(False)
    w.add_chat_template(template)
    rng = np.random.default_rng(0)
    f32 = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32)
    embd = gguf.quants.quantize(f32(VOCAB_SIZE, d), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", embd, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    q, kv = n_head * head_dim, n_kv * head_dim
    layer = {
        "attn_norm": np.ones(d, np.float32), "attn_q": f32(q, d), "attn_k": f32(kv, d), "attn_v": f32(kv, d),
        "attn_output": f32(d, q), "attn_q_norm": np.ones(head_dim, np.float32), "attn_k_norm": np.ones(head_dim, np.float32),
        "ffn_norm": np.ones(d, np.float32), "ffn_gate_inp": f32(n_exp, d), "ffn_gate_exps": f32(n_exp, d_ff, d),
        "ffn_up_exps": f32(n_exp, d_ff, d), "ffn_down_exps": f32(n_exp, d, d_ff),
    }
    for name, arr in layer.items():
        w.add_tensor(f"blk.0.{name}.weight", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------- corpus

PROSE = {
    "en": "The committee met on Tuesday to discuss the budget; nobody agreed, but everyone left with a clearer idea of what they'd disagreed about.",
    "de": "Die Straßenbahn fährt über die Brücke, während die Möwen über dem Fluss kreisen und ein älterer Herr seine Zeitung faltet.",
    "fr": "L'été dernier, nous sommes allés à la côte ; c'était magnifique, même si la mer était un peu froide pour se baigner.",
    "es": "¿Dónde está la biblioteca? Mañana iremos al médico y después compraremos pan en la panadería de la esquina.",
    "pl": "Zażółć gęślą jaźń: źdźbło trawy kołysało się na wietrze, a chłopiec biegł przez łąkę do domu.",
    "tr": "İstanbul'da yağmur yağarken çay içmek ve Boğaz'ı seyretmek, şehrin en güzel alışkanlıklarından biridir.",
    "vi": "Hôm nay trời đẹp, chúng tôi đi dạo quanh hồ Hoàn Kiếm và ăn phở ở một quán nhỏ gần đó.",
    "ru": "Вчера вечером мы долго гуляли по набережной, разговаривали о книгах и смотрели, как над рекой зажигаются огни.",
    "uk": "Ґрунтовні дослідження показали, що їжак і єнот часто живуть поруч у міських парках.",
    "el": "Η Αθήνα είναι μια πόλη με μακρά ιστορία· οι αρχαίοι ναοί της στέκονται ακόμη πάνω στον λόφο.",
    "ka": "თბილისი საქართველოს დედაქალაქია და მდებარეობს მტკვრის ნაპირებზე.",
    "hy": "Երևանը Հայաստանի մայրաքաղաքն է, որը հայտնի է իր վարդագույն տուֆե շենքերով։",
    "ar": "ذهبنا إلى السوق في الصباح الباكر، واشترينا الخبز الطازج والزيتون والتمر قبل أن يشتد الحر.",
    "he": "בבוקר הלכנו לשוק, קנינו ירקות טריים ושתינו קפה בבית קפה קטן ליד התחנה.",
    "fa": "دیروز با دوستانم به کوه رفتیم و از منظرهٔ زیبای شهر در غروب آفتاب لذت بردیم.",
    "hi": "कल शाम हम नदी के किनारे टहलने गए और सूरज को धीरे-धीरे डूबते हुए देखा।",
    "bn": "গতকাল আমরা গ্রামের মেলায় গিয়েছিলাম এবং সেখানে অনেক রকমের মিষ্টি খেয়েছিলাম।",
    "ta": "நேற்று மாலை நாங்கள் கடற்கரையில் நடந்து சென்று அலைகளைப் பார்த்தோம்.",
    "th": "เมื่อวานนี้เราไปเที่ยวตลาดน้ำ และกินก๋วยเตี๋ยวเรือที่อร่อยมาก",
    "zh": "人工智能是计算机科学的一个分支，它试图理解智能的本质，并生产出一种新的能以人类智能相似的方式做出反应的智能机器。",
    "zh_TW": "臺北的夜市裡人聲鼎沸，攤販們忙著招呼客人，空氣中瀰漫著各式小吃的香氣。",
    "ja": "昨日は雨が降っていたので、家で本を読んだり、音楽を聴いたりして、のんびり過ごしました。カタカナもひらがなも漢字も。",
    "ko": "어제는 친구들과 함께 한강 공원에 가서 자전거를 타고 치킨을 먹었습니다.",
    "am": "አዲስ አበባ የኢትዮጵያ ዋና ከተማ ናት።",
    "my": "ရန်ကုန်မြို့သည် မြန်မာနိုင်ငံ၏ အကြီးဆုံးမြို့ ဖြစ်သည်။",
    "km": "ភ្នំពេញគឺជារាជធានីនៃព្រះរាជាណាចក្រកម្ពុជា។",
    "si": "කොළඹ ශ්‍රී ලංකාවේ විශාලතම නගරයයි.",
    "math": "∀ε>0 ∃δ>0: |x−a|<δ ⇒ |f(x)−f(a)|<ε; ∑ᵢ₌₁ⁿ i² = n(n+1)(2n+1)/6; ∫₀^∞ e^{−x²} dx = √π/2; ℝ ⊂ ℂ, ℵ₀.",
    "combining": "e\u0301 a\u0308 n\u0303 Z\u0335\u0321a\u0336l\u0337g\u0338o\u0334 \u1e9b\u0323 \ufb01 \u2126 \u212b \uff21\uff22\uff23 \u00bd \u2460",
}

LOCALE_LANGS = ["zh_CN", "zh_TW", "ja", "ko", "ru", "uk", "bg", "sr", "el", "ka", "hy", "ar", "he", "fa", "ur",
                "hi", "bn", "ta", "te", "kn", "ml", "mr", "gu", "pa", "th", "lo", "km", "my", "si", "am",
                "vi", "tr", "de", "fr", "es", "pt_BR", "it", "pl", "cs", "hu", "ro", "fi", "sv", "eo", "ga", "cy"]


def locale_docs(per_lang):
    """Translated messages from the installed gettext catalogs: real prose in many scripts."""
    docs = []
    for lang in LOCALE_LANGS:
        texts, size = [], 0
        for mo in sorted(glob.glob(f"/usr/share/locale/{lang}/LC_MESSAGES/*.mo")):
            try:
                with open(mo, "rb") as f:
                    catalog = gettext.GNUTranslations(f)._catalog
            except Exception:
                continue
            for key, value in sorted(catalog.items(), key=lambda kv: str(kv[0])):
                if key and isinstance(value, str) and value.strip():
                    texts.append(value)
                    size += len(value.encode())
                if size >= per_lang:
                    break
            if size >= per_lang:
                break
        if texts:
            docs.append((f"locale/{lang}", "\n".join(texts)))
    return docs


def source_docs(limit):
    files = subprocess.check_output(["git", "ls-files"], cwd=REPO, text=True).split()
    docs, size = [], 0
    for f in sorted(files):
        if not f.endswith((".rs", ".py", ".md", ".toml", ".cu", ".cuh", ".jinja", ".sh", ".yml", ".txt")):
            continue
        try:
            text = open(os.path.join(REPO, f), encoding="utf-8").read()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        docs.append((f"src/{f}", text))
        size += len(text.encode())
        if size >= limit:
            break
    return docs


def emoji_docs(rng, n):
    singles = [chr(c) for r in [(0x1F300, 0x1F5FF), (0x1F600, 0x1F64F), (0x1F680, 0x1F6FF), (0x1F900, 0x1F9FF), (0x2600, 0x26FF), (0x2700, 0x27BF)] for c in range(*r)]
    tones = [chr(c) for c in range(0x1F3FB, 0x1F400)]
    zwj = ["👨‍👩‍👧‍👦", "👩‍💻", "🏳️‍🌈", "🧑🏽‍🚀", "👁️‍🗨️", "❤️‍🔥", "🐻‍❄️"]
    flags = [chr(0x1F1E6 + a) + chr(0x1F1E6 + b) for a, b in [(5, 17), (3, 4), (9, 15), (20, 18), (1, 17), (8, 13), (2, 13)]]
    keycaps = [c + "\ufe0f\u20e3" for c in "0123456789#*"]
    words = ["so", "happy", "today", "lol", "great job", "see you", "ok", "行", "好的", "спасибо"]
    docs = []
    for i in range(n):
        parts = []
        for _ in range(rng.randint(200, 600)):
            k = rng.random()
            if k < 0.4:
                parts.append(rng.choice(singles))
            elif k < 0.5:
                parts.append(rng.choice(singles[:200]) + rng.choice(tones))
            elif k < 0.6:
                parts.append(rng.choice(zwj))
            elif k < 0.7:
                parts.append(rng.choice(flags))
            elif k < 0.75:
                parts.append(rng.choice(keycaps))
            elif k < 0.8:
                parts.append(rng.choice(singles) + "\ufe0f")
            else:
                parts.append(rng.choice(words))
            parts.append(rng.choice(["", "", " ", "  ", "\n"]))
        docs.append((f"emoji/{i}", "".join(parts)))
    return docs


def whitespace_docs(rng, n):
    pieces = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\u00a0", "\u3000", "\u2003", "\u200b", "\x0b", "\x0c"]
    words = ["if", "x", "return", "foo()", "{", "}", "mot", "слово", "字", "42", "'s", "'LL", "...", "--"]
    docs = []
    for i in range(n):
        parts = []
        for _ in range(rng.randint(300, 900)):
            k = rng.random()
            if k < 0.1:
                parts.append(" " * rng.randint(4, 200))
            elif k < 0.15:
                parts.append("\n" * rng.randint(2, 30))
            elif k < 0.55:
                parts.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 6))))
            else:
                parts.append(rng.choice(words))
        docs.append((f"whitespace/{i}", "".join(parts)))
    return docs


def special_docs(rng, n, prose):
    specials = [t for t, _ in ADDED]
    docs = []
    for i in range(n):
        parts = []
        for _ in range(rng.randint(20, 60)):
            k = rng.random()
            if k < 0.3:
                parts.append(rng.choice(specials))
            elif k < 0.4:
                s = rng.choice(specials)
                parts.append(s[: rng.randint(1, len(s) - 1)])  # a broken special stays text
            elif k < 0.5:
                parts.append(rng.choice(["user\n", "assistant\n", "system\n", "\n"]))
            else:
                parts.append(rng.choice(prose))
        docs.append((f"specials/{i}", "".join(parts)))
    return docs


def corpus(min_bytes):
    rng = random.Random(20260601)
    prose = list(PROSE.values())
    docs = [(f"prose/{k}", v) for k, v in PROSE.items()]
    docs += locale_docs(per_lang=24 << 10)
    docs += emoji_docs(rng, 24)
    docs += whitespace_docs(rng, 24)
    docs += special_docs(rng, 40, prose)
    size = sum(len(t.encode()) for _, t in docs)
    docs += source_docs(limit=max(min_bytes - size, 0) + (600 << 10))
    return docs


# ---------------------------------------------------------------- the two references

def tiktoken_encoding(ranks):
    import tiktoken

    specials = {t: N_BPE + i for i, (t, _) in enumerate(ADDED)}
    return tiktoken.Encoding("qwen3", pat_str=PAT, mergeable_ranks=ranks, special_tokens=specials)


def hf_tokenizer(tokens, types, merges):
    """A BPE built straight from the tokens and merges: the split regex, byte-level respelling
    without GPT-2's regex, and the added tokens (control ones special)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens[:N_BPE])}
    pairs = [tuple(m.split(" ")) for m in merges]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    tk.add_tokens([AddedToken(t, special=(ty == 3), normalized=False) for t, ty in ADDED])
    assert [tk.token_to_id(t) for t, _ in ADDED] == list(range(N_BPE, N_BPE + len(ADDED)))
    return tk


def check_docs(docs, enc, hf):
    """Ids with every added token parsed, and with control tokens as text (user-defined ones are
    always matched whole, as in llama.cpp and transformers)."""
    user = {t for t, ty in ADDED if ty == 4}
    out, mismatches, n_tokens = [], [], 0
    for name, text in docs:
        ids = enc.encode(text, allowed_special="all")
        plain = enc.encode(text, allowed_special=user, disallowed_special=())
        hf.encode_special_tokens = False
        hf_ids = hf.encode(text, add_special_tokens=False).ids
        hf.encode_special_tokens = True
        hf_plain = hf.encode(text, add_special_tokens=False).ids
        problems = []
        if hf_ids != ids:
            problems.append("ids: tiktoken != tokenizers")
        if hf_plain != plain:
            problems.append("plain ids: tiktoken != tokenizers")
        for label, seq in (("ids", ids), ("plain", plain)):
            if enc.decode(seq) != text:
                problems.append(f"tiktoken decode of {label} differs")
            if hf.decode(seq, skip_special_tokens=False) != text:
                problems.append(f"tokenizers decode of {label} differs")
        if problems:
            mismatches.append((name, problems))
        n_tokens += len(ids)
        out.append({"name": name, "text": text, "ids": ids, "ids_plain": None if plain == ids else plain})
    return out, mismatches, n_tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiktoken", help="path to qwen.tiktoken (default: from the dashscope wheel)")
    ap.add_argument("--cache", default=os.path.join(REPO, "target", "qwen_vocab_cache"))
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--min-bytes", type=int, default=1 << 20)
    args = ap.parse_args()

    t0 = time.time()
    if args.tiktoken:
        data, origin = open(args.tiktoken, "rb").read(), args.tiktoken
    else:
        data, origin = fetch_tiktoken(args.cache)
    ranks = load_ranks(data)
    merges, unreachable = merges_from_ranks(ranks)
    tokens, types = vocabulary(ranks)
    print(f"vocabulary: {len(ranks)} ranked tokens from {origin} (sha256 {hashlib.sha256(data).hexdigest()[:16]}), "
          f"{len(merges)} merges, {len(unreachable)} multi-byte tokens no merge reaches, {len(tokens)} ids "
          f"({time.time() - t0:.1f} s)")

    os.makedirs(args.out, exist_ok=True)
    template = open(os.path.join(REPO, "crates", "tokenizer", "src", "qwen3_chat_template.jinja")).read()
    gguf_path = os.path.join(args.out, "qwen3_vocab.gguf")
    write_gguf(gguf_path, tokens, types, merges, template)
    print(f"wrote {gguf_path} ({os.path.getsize(gguf_path) / 1e6:.1f} MB)")

    docs = corpus(args.min_bytes)
    n_bytes = sum(len(t.encode()) for _, t in docs)
    assert n_bytes >= args.min_bytes, f"corpus is only {n_bytes} bytes"
    by_kind = collections.Counter()
    for name, text in docs:
        by_kind[name.split("/")[0]] += len(text.encode())
    out, mismatches, n_tokens = check_docs(docs, tiktoken_encoding(ranks), hf_tokenizer(tokens, types, merges))
    fixture = {"version": FIXTURE_VERSION, "vocab_sha256": hashlib.sha256(data).hexdigest(), "docs": out}
    path = os.path.join(args.out, "expected.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False)
    print(f"corpus: {len(docs)} documents, {n_bytes} bytes ({', '.join(f'{k} {v}' for k, v in sorted(by_kind.items()))}), "
          f"{n_tokens} tokens")
    print(f"tiktoken vs tokenizers: {len(mismatches)} mismatching documents")
    for name, problems in mismatches[:20]:
        print(f"  {name}: {'; '.join(problems)}")
    print(f"wrote {path}; now: cargo test -p q4moe-fuzz --test qwen_vocab")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())

//! `synthetic_spec`: a Qwen3-shaped byte-level BPE vocabulary for synthetic models and tests.
//!
//! Layout (as in Qwen3): 256 byte tokens, then merged tokens in merge-rank order, then Qwen3's 26
//! added tokens, then `[PADn]` padding up to the requested size (only when the size exceeds
//! Qwen3's 151643 BPE tokens + 26). Merges come from (1) real BPE training over an embedded
//! English/code/CJK sample, then (2) seeded growth of word-like pieces.

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

use crate::bytes::byte_to_unicode;
use crate::chat::QWEN3_CHAT_TEMPLATE;
use crate::tokenizer::{split_then_bytes, QWEN2_SPLIT};
use crate::{TokenType, TokenizerSpec};

/// Qwen3's vocabulary size (embedding rows).
pub const QWEN3_VOCAB_SIZE: usize = 151_936;
/// Qwen3's byte-level BPE tokens (ids below the first added token, `<|endoftext|>` = 151643).
pub const QWEN3_BPE_TOKENS: usize = 151_643;
/// Qwen3's added tokens in id order, with llama.cpp's token type (control 3, user-defined 4).
pub const QWEN3_ADDED_TOKENS: [(&str, i32); 26] = [
    ("<|endoftext|>", 3),
    ("<|im_start|>", 3),
    ("<|im_end|>", 3),
    ("<|object_ref_start|>", 3),
    ("<|object_ref_end|>", 3),
    ("<|box_start|>", 3),
    ("<|box_end|>", 3),
    ("<|quad_start|>", 3),
    ("<|quad_end|>", 3),
    ("<|vision_start|>", 3),
    ("<|vision_end|>", 3),
    ("<|vision_pad|>", 3),
    ("<|image_pad|>", 3),
    ("<|video_pad|>", 3),
    ("<tool_call>", 4),
    ("</tool_call>", 4),
    ("<|fim_prefix|>", 3),
    ("<|fim_middle|>", 3),
    ("<|fim_suffix|>", 3),
    ("<|fim_pad|>", 3),
    ("<|repo_name|>", 3),
    ("<|file_sep|>", 3),
    ("<tool_response>", 4),
    ("</tool_response>", 4),
    ("<think>", 4),
    ("</think>", 4),
];

const SAMPLE: &str = include_str!("sample.txt");
/// The smallest `synthetic_spec` vocabulary: the 256 bytes, Qwen3's added tokens and a few
/// dozen merges.
pub const SYNTHETIC_MIN_VOCAB: usize = 256 + QWEN3_ADDED_TOKENS.len() + 32;
const SYLLABLES: &str = "ing ed er es ly al ion tion sion ment ness able ible ic ous ive ize ure ity ant ent ist ism \
    an en in on or ar at it le re ra ro la li lo ma mi mo na ne ni no ta te ti to co de di pa pe po se si so \
    ve vi ber ter der ger ther ture ate ite ine ance ence ful less ward ure age ery ory ary ical ual";
/// Grown pieces stay word-sized.
const MAX_PIECE_CHARS: usize = 16;

/// A deterministic Qwen3-like spec of exactly `vocab_size` tokens (see the module docs).
/// eos = `<|im_end|>`, bos = pad = `<|endoftext|>`, add_bos false: as in Qwen3 GGUFs.
/// Callers check `vocab_size >= SYNTHETIC_MIN_VOCAB` first (a smaller one is a bug: it panics).
pub fn synthetic_spec(vocab_size: usize, seed: u64) -> TokenizerSpec {
    assert!(
        vocab_size >= SYNTHETIC_MIN_VOCAB,
        "synthetic_spec: vocab_size {vocab_size} < minimum {SYNTHETIC_MIN_VOCAB}"
    );
    let n_bpe = (vocab_size - QWEN3_ADDED_TOKENS.len()).min(QWEN3_BPE_TOKENS);
    let mut v = VocabBuilder::bytes();
    train(&mut v, n_bpe);
    add_base_pieces(&mut v, n_bpe);
    grow(&mut v, n_bpe, seed);
    assert_eq!(
        v.tokens.len(),
        n_bpe,
        "synthetic vocabulary generation fell short"
    );

    let mut token_types = vec![TokenType::Normal as i32; n_bpe];
    let first_added = v.tokens.len() as u32;
    for (t, ty) in QWEN3_ADDED_TOKENS {
        v.tokens.push(t.to_string());
        token_types.push(ty);
    }
    // llama.cpp's convert fills ids the tokenizer lacks with "[PADn]" of type UNUSED.
    for id in v.tokens.len()..vocab_size {
        v.tokens.push(format!("[PAD{id}]"));
        token_types.push(TokenType::Unused as i32);
    }
    TokenizerSpec {
        model: "gpt2".into(),
        pre: "qwen2".into(),
        tokens: v.tokens,
        token_types,
        merges: v.merges,
        bos_id: Some(first_added),
        eos_id: first_added + 2,
        pad_id: Some(first_added),
        add_bos: false,
        chat_template: Some(QWEN3_CHAT_TEMPLATE.to_string()),
    }
}

struct VocabBuilder {
    tokens: Vec<String>,
    ids: HashMap<String, u32>,
    merges: Vec<String>,
}

impl VocabBuilder {
    fn bytes() -> Self {
        let tokens: Vec<String> = (0..=255u8)
            .map(|b| byte_to_unicode(b).to_string())
            .collect();
        let ids = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        Self {
            tokens,
            ids,
            merges: Vec::new(),
        }
    }

    /// Records merge `a b` and its new token; `None` when the result already exists.
    fn merge(&mut self, a: u32, b: u32) -> Option<u32> {
        let piece = format!("{}{}", self.tokens[a as usize], self.tokens[b as usize]);
        if self.ids.contains_key(&piece) {
            return None;
        }
        let id = self.tokens.len() as u32;
        self.merges.push(format!(
            "{} {}",
            self.tokens[a as usize], self.tokens[b as usize]
        ));
        self.ids.insert(piece.clone(), id);
        self.tokens.push(piece);
        Some(id)
    }

    fn id(&self, piece: &str) -> Option<u32> {
        self.ids.get(piece).copied()
    }
}

/// Byte-level words of the sample under the Qwen2 split, with counts, in first-seen order.
fn sample_words() -> Vec<(Vec<u32>, usize)> {
    let mut pts = PreTokenizedString::from(SAMPLE);
    split_then_bytes(QWEN2_SPLIT)
        .pre_tokenize(&mut pts)
        .expect("pre-tokenize sample");
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut words: Vec<(Vec<u32>, usize)> = Vec::new();
    for (piece, _, _) in pts.get_splits(OffsetReferential::Original, OffsetType::Byte) {
        let i = *index.entry(piece.to_string()).or_insert_with(|| {
            let syms = piece
                .chars()
                .map(|c| u32::from(crate::unicode_to_byte(c).expect("byte char")))
                .collect();
            words.push((syms, 0));
            words.len() - 1
        });
        words[i].1 += 1;
    }
    words
}

/// Plain BPE training: repeatedly merge the most frequent adjacent pair (ties: lowest ids) until
/// no pair occurs twice or the budget is reached.
fn train(v: &mut VocabBuilder, n_bpe: usize) {
    let mut words = sample_words();
    while v.tokens.len() < n_bpe {
        let mut counts: HashMap<(u32, u32), usize> = HashMap::new();
        for (syms, n) in &words {
            for w in syms.windows(2) {
                *counts.entry((w[0], w[1])).or_default() += n;
            }
        }
        let best = counts
            .into_iter()
            .max_by(|(p, c), (q, d)| c.cmp(d).then(q.cmp(p)));
        let Some(((a, b), _)) = best.filter(|&(_, c)| c >= 2) else {
            break;
        };
        let new = match v.merge(a, b) {
            Some(id) => id,
            // The result exists already (reached by another split): a second merge, no new token.
            None => {
                let (sa, sb) = (&v.tokens[a as usize], &v.tokens[b as usize]);
                v.merges.push(format!("{sa} {sb}"));
                v.id(&format!("{sa}{sb}")).expect("token exists")
            }
        };
        for (syms, _) in &mut words {
            replace_pair(syms, a, b, new);
        }
    }
}

fn replace_pair(syms: &mut Vec<u32>, a: u32, b: u32, new: u32) {
    let mut out = Vec::with_capacity(syms.len());
    let mut i = 0;
    while i < syms.len() {
        if i + 1 < syms.len() && syms[i] == a && syms[i + 1] == b {
            out.push(new);
            i += 2;
        } else {
            out.push(syms[i]);
            i += 1;
        }
    }
    *syms = out;
}

/// Pieces every real vocabulary has: space + letter, indentation runs, blank lines.
fn add_base_pieces(v: &mut VocabBuilder, n_bpe: usize) {
    let letters = (b'a'..=b'z').chain(b'A'..=b'Z');
    let mut pairs: Vec<(String, String)> = letters
        .map(|c| ("Ġ".to_string(), (c as char).to_string()))
        .collect();
    for (unit, max) in [("Ġ", 16), ("Ċ", 4), ("ĉ", 4)] {
        for n in 2..=max {
            pairs.push((unit.repeat(n - 1), unit.to_string()));
        }
    }
    // Common English syllables, built left to right, feed `grow` with plausible continuations.
    for syl in SYLLABLES.split(' ') {
        let chars: Vec<String> = syl.chars().map(String::from).collect();
        for k in 1..chars.len() {
            pairs.push((chars[..k].concat(), chars[k].clone()));
        }
    }
    pairs.push(("Ċ".into(), "ĠĠĠ".into()));
    pairs.push(("Ċ".into(), "ĠĠĠĠĠĠĠ".into()));
    for (a, b) in pairs {
        if v.tokens.len() >= n_bpe {
            return;
        }
        if let (Some(a), Some(b)) = (v.id(&a), v.id(&b)) {
            v.merge(a, b);
        }
    }
}

/// Seeded growth: join a word-start piece ("Ġth", "in") with a lowercase syllable ("ing"),
/// preferring early (frequent) pieces and keeping the result pronounceable, until the budget.
fn grow(v: &mut VocabBuilder, n_bpe: usize, seed: u64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let is_cont = |s: &str| (2..=4).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_lowercase());
    let is_start = |s: &str| {
        let rest = s.strip_prefix('Ġ').unwrap_or(s);
        !rest.is_empty() && rest.len() <= 10 && rest.bytes().all(|b| b.is_ascii_alphabetic())
    };
    let filter = |v: &VocabBuilder, f: &dyn Fn(&str) -> bool| -> Vec<u32> {
        (0..v.tokens.len() as u32)
            .filter(|&i| f(&v.tokens[i as usize]))
            .collect()
    };
    let mut starts = filter(v, &is_start);
    let conts = filter(v, &is_cont);
    let mut misses = 0u32;
    while v.tokens.len() < n_bpe {
        // Squaring a uniform draw favours low ids; after repeated misses fall back to uniform.
        let skew = if misses > 32 { 1 } else { 2 };
        let mut pick =
            |pool: &[u32]| pool[(rng.gen::<f64>().powi(skew) * pool.len() as f64) as usize];
        let (a, b) = (pick(&starts), pick(&conts));
        let joined = format!("{}{}", v.tokens[a as usize], v.tokens[b as usize]);
        let ok = joined.chars().count() <= MAX_PIECE_CHARS && pronounceable(&joined);
        match ok.then(|| v.merge(a, b)).flatten() {
            Some(id) => {
                misses = 0;
                if is_start(&v.tokens[id as usize]) {
                    starts.push(id);
                }
            }
            None => misses += 1,
        }
    }
}

/// No more than three consonants or two vowels in a row (y counts as both).
fn pronounceable(piece: &str) -> bool {
    let (mut cons, mut vows) = (0, 0);
    for c in piece
        .trim_start_matches('Ġ')
        .chars()
        .map(|c| c.to_ascii_lowercase())
    {
        let vowel = "aeiouy".contains(c);
        let consonant = c != 'a' && c != 'e' && c != 'i' && c != 'o' && c != 'u';
        cons = if consonant { cons + 1 } else { 0 };
        vows = if vowel { vows + 1 } else { 0 };
        if cons > 3 || vows > 2 {
            return false;
        }
    }
    true
}

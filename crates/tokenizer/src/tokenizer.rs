//! [`Tokenizer`]: a `tokenizers::Tokenizer` assembled in code from a [`TokenizerSpec`], the way
//! transformers' GGUF loader assembles it (BPE + split regex + ByteLevel + added tokens).

use std::collections::HashMap;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::bytes::{decode_piece, encode_bytes, in_alphabet};
use crate::{TokenType, TokenizerError, TokenizerSpec};

/// llama.cpp's `LLAMA_VOCAB_PRE_TYPE_QWEN2` regex (identical to transformers' Qwen2 PRETOKENIZE_REGEX).
pub(crate) const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's `LLAMA_VOCAB_PRE_TYPE_LLAMA3` regex.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const SUPPORTED_PRE: &str = "supported: qwen2, deepseek-r1-qwen, llama-bpe, llama3, default, gpt-2";

pub struct Tokenizer {
    /// Matches control tokens in the text (`parse_special = true`).
    special: tokenizers::Tokenizer,
    /// Same, with `encode_special_tokens` set: control tokens are plain text.
    plain: tokenizers::Tokenizer,
    /// Raw bytes of every id, for [`crate::StreamDecoder`].
    pub(crate) token_bytes: Vec<Vec<u8>>,
    /// Control tokens, which `skip_special` drops.
    pub(crate) is_control: Vec<bool>,
    ids: HashMap<String, u32>,
    bos_id: Option<u32>,
    eos_id: u32,
    add_bos: bool,
    stop_ids: Vec<u32>,
    chat_template: Option<String>,
}

impl Tokenizer {
    pub fn from_spec(spec: &TokenizerSpec) -> Result<Self, TokenizerError> {
        validate(spec)?;
        let vocab = vocab_of(spec);
        let merges = merges_of(spec, &vocab)?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab.clone(), merges)
            .build()
            .map_err(|e| TokenizerError::spec("merges", e.to_string()))?;
        let mut special = tokenizers::Tokenizer::new(bpe);
        special.with_pre_tokenizer(Some(pre_tokenizer(&spec.pre)?));
        special.with_decoder(Some(ByteLevelDecoder::default()));
        add_added_tokens(&mut special, spec, &vocab);
        let mut plain = special.clone();
        plain.set_encode_special_tokens(true);

        let n = spec.tokens.len();
        let piece = |id: usize| special.id_to_token(id as u32).unwrap_or_default();
        let token_bytes = (0..n).map(|id| decode_piece(&piece(id))).collect();
        let is_control = (0..n)
            .map(|id| special.get_added_vocabulary().is_special_token(&piece(id)))
            .collect();
        let ids: HashMap<String, u32> = spec
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let mut stop_ids = vec![spec.eos_id];
        for s in ["<|im_end|>", "<|endoftext|>"] {
            if let Some(&id) = ids.get(s) {
                if !stop_ids.contains(&id) {
                    stop_ids.push(id);
                }
            }
        }
        Ok(Self {
            special,
            plain,
            token_bytes,
            is_control,
            ids,
            bos_id: spec.bos_id,
            eos_id: spec.eos_id,
            add_bos: spec.add_bos,
            stop_ids,
            chat_template: spec.chat_template.clone(),
        })
    }

    /// Token ids of `text`, with BOS first when the spec says `add_bos`. With `parse_special`, control
    /// tokens written in the text (`<|im_start|>`) become their ids; user-defined tokens (`<think>`)
    /// are always matched whole, as in llama.cpp and transformers.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let tk = if parse_special {
            &self.special
        } else {
            &self.plain
        };
        let enc = tk
            .encode(text, false)
            .map_err(|e| TokenizerError::Backend(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if let (true, Some(bos)) = (self.add_bos, self.bos_id) {
            ids.push(bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Text of `ids`; invalid UTF-8 (a cut multi-byte char) becomes U+FFFD, as in transformers.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.check_ids(ids)?;
        self.special
            .decode(ids, skip_special)
            .map_err(|e| TokenizerError::Backend(e.to_string()))
    }

    pub(crate) fn check_ids(&self, ids: &[u32]) -> Result<(), TokenizerError> {
        match ids.iter().find(|&&id| id as usize >= self.vocab_size()) {
            Some(&id) => Err(TokenizerError::UnknownId {
                id,
                vocab_size: self.vocab_size(),
            }),
            None => Ok(()),
        }
    }

    /// Number of token ids (the embedding rows), specials and padding included.
    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// Id of a vocabulary entry, spelled as in the spec (`"Ġthe"`, `"<|im_end|>"`).
    pub fn token_id(&self, piece: &str) -> Option<u32> {
        self.ids.get(piece).copied()
    }

    /// Raw bytes a token stands for.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.token_bytes.get(id as usize).map(Vec::as_slice)
    }

    /// Ids that end generation: EOS, plus `<|im_end|>` and `<|endoftext|>` when present.
    pub fn stop_ids(&self) -> Vec<u32> {
        self.stop_ids.clone()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    pub fn eos_id(&self) -> u32 {
        self.eos_id
    }

    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Incremental detokenizer over this vocabulary.
    pub fn stream_decoder(&self, skip_special: bool) -> crate::StreamDecoder<&Tokenizer> {
        crate::StreamDecoder::new(self, skip_special)
    }
}

fn validate(spec: &TokenizerSpec) -> Result<(), TokenizerError> {
    if spec.model != "gpt2" {
        return Err(TokenizerError::Unsupported {
            field: "model",
            value: spec.model.clone(),
            supported: "only \"gpt2\" (byte-level BPE) is supported",
        });
    }
    let n = spec.tokens.len();
    if n == 0 {
        return Err(TokenizerError::spec("tokens", "empty vocabulary"));
    }
    if spec.token_types.len() != n {
        let msg = format!("has {} entries but tokens has {n}", spec.token_types.len());
        return Err(TokenizerError::spec("token_types", msg));
    }
    let check = |field: &'static str, id: Option<u32>| match id {
        Some(id) if id as usize >= n => Err(TokenizerError::spec(
            field,
            format!("id {id} >= vocab size {n}"),
        )),
        _ => Ok(()),
    };
    check("bos_id", spec.bos_id)?;
    check("eos_id", Some(spec.eos_id))?;
    check("pad_id", spec.pad_id)?;
    if spec.add_bos && spec.bos_id.is_none() {
        return Err(TokenizerError::spec(
            "add_bos",
            "is true but bos_id is missing",
        ));
    }
    Ok(())
}

/// Token -> id. Like transformers, a token spelled outside the byte alphabet is respelled from its
/// UTF-8 bytes, and a duplicate spelling maps to its last id (llama.cpp does the same).
fn vocab_of(spec: &TokenizerSpec) -> Vocab {
    spec.tokens
        .iter()
        .enumerate()
        .map(|(id, t)| {
            let t = if in_alphabet(t) {
                t.clone()
            } else {
                encode_bytes(t.as_bytes())
            };
            (t, id as u32)
        })
        .collect()
}

/// Parses "left right" pairs, naming the first bad merge precisely.
fn merges_of(spec: &TokenizerSpec, vocab: &Vocab) -> Result<Vec<(String, String)>, TokenizerError> {
    spec.merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let (a, b) = m
                .split_once(' ')
                .filter(|(a, b)| !a.is_empty() && !b.is_empty() && !b.contains(' '))
                .ok_or_else(|| {
                    TokenizerError::spec(
                        "merges",
                        format!("merges[{i}] = {m:?} is not \"left right\""),
                    )
                })?;
            for part in [a, b, &format!("{a}{b}")] {
                if !vocab.contains_key(part) {
                    let msg = format!("merges[{i}] = {m:?} references unknown token {part:?}");
                    return Err(TokenizerError::spec("merges", msg));
                }
            }
            Ok((a.to_string(), b.to_string()))
        })
        .collect()
}

fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper, TokenizerError> {
    let regex = match pre {
        "qwen2" | "deepseek-r1-qwen" => QWEN2_SPLIT,
        "llama-bpe" | "llama3" | "llama-v3" => LLAMA3_SPLIT,
        // GPT-2's own regex lives inside the ByteLevel pre-tokenizer.
        "default" | "gpt-2" | "gpt2" => return Ok(ByteLevel::new(false, true, true).into()),
        _ => {
            return Err(TokenizerError::Unsupported {
                field: "pre",
                value: pre.into(),
                supported: SUPPORTED_PRE,
            })
        }
    };
    Ok(split_then_bytes(regex))
}

/// The regex split, then byte-level respelling without GPT-2's own regex.
pub(crate) fn split_then_bytes(regex: &str) -> PreTokenizerWrapper {
    let split = Split::new(
        SplitPattern::Regex(regex.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .expect("built-in split regex compiles");
    Sequence::new(vec![
        split.into(),
        ByteLevel::new(false, true, false).into(),
    ])
    .into()
}

/// Control tokens become special added tokens, user-defined ones non-special added tokens: both are
/// matched whole in the text. Control tokens spelled outside the byte alphabet are skipped, as
/// transformers does (they are llama.cpp mislabels).
fn add_added_tokens(tk: &mut tokenizers::Tokenizer, spec: &TokenizerSpec, vocab: &Vocab) {
    let of_type = |ty: TokenType| {
        spec.tokens
            .iter()
            .zip(&spec.token_types)
            .filter(move |(_, &t)| t == ty as i32)
    };
    let control: Vec<AddedToken> = of_type(TokenType::Control)
        .filter(|(t, _)| in_alphabet(t))
        .map(|(t, _)| AddedToken::from(t.clone(), true).normalized(false))
        .collect();
    tk.add_special_tokens(&control);
    let user: Vec<AddedToken> = of_type(TokenType::UserDefined)
        .filter(|(t, _)| vocab.contains_key(t.as_str()))
        .map(|(t, _)| AddedToken::from(t.clone(), false).normalized(false))
        .collect();
    tk.add_tokens(&user);
}

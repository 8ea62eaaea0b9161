//! [`Tokenizer`]: a `tokenizers::Tokenizer` assembled in code from a [`TokenizerSpec`], the way
//! transformers' GGUF loader assembles it (BPE + split regex + ByteLevel + added tokens).

use std::collections::{HashMap, HashSet};

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;

use crate::added::{AddedTokens, Segment};
use crate::bytes::{decode_piece, encode_bytes, in_alphabet};
use crate::{ChatMessage, RenderedPrompt, TokenType, TokenizerError, TokenizerSpec};

/// llama.cpp's `LLAMA_VOCAB_PRE_TYPE_QWEN2` regex (identical to transformers' Qwen2 PRETOKENIZE_REGEX).
pub(crate) const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's `LLAMA_VOCAB_PRE_TYPE_LLAMA3` regex.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const SUPPORTED_PRE: &str = "supported: qwen2, deepseek-r1-qwen, llama-bpe, llama3, default, gpt-2";

pub struct Tokenizer {
    /// BPE, split regex and byte-level decoder, without added tokens: [`AddedTokens`] finds those.
    bpe: tokenizers::Tokenizer,
    /// Control and user-defined tokens, matched whole before BPE.
    added: AddedTokens,
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
    /// The longest spelling in the vocabulary: no token stands for more bytes of text.
    max_token_len: usize,
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
        let mut tk = tokenizers::Tokenizer::new(bpe);
        tk.with_pre_tokenizer(Some(pre_tokenizer(&spec.pre)?));
        tk.with_decoder(Some(ByteLevelDecoder::default()));
        let added = added_tokens(spec, &vocab)?;

        let n = spec.tokens.len();
        let control: HashSet<&str> = control_tokens(spec).collect();
        let piece = |id: usize| tk.id_to_token(id as u32).unwrap_or_default();
        let token_bytes = (0..n).map(|id| decode_piece(&piece(id))).collect();
        let is_control = (0..n)
            .map(|id| control.contains(piece(id).as_str()))
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
            bpe: tk,
            added,
            token_bytes,
            is_control,
            ids,
            max_token_len: spec
                .tokens
                .iter()
                .map(String::len)
                .max()
                .unwrap_or(1)
                .max(1),
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
        self.encode_except(text, parse_special, &[])
    }

    fn encode_except(
        &self,
        text: &str,
        parse_special: bool,
        literal_at: &[usize],
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::new();
        if let (true, Some(bos)) = (self.add_bos, self.bos_id) {
            ids.push(bos);
        }
        // Each text piece is pre-tokenized on its own, as `tokenizers` does around added tokens.
        for segment in self.added.split_except(text, parse_special, literal_at) {
            match segment {
                Segment::Token(id) => ids.push(id),
                Segment::Text(piece) => ids.extend_from_slice(&self.bpe_ids(piece)?),
            }
        }
        Ok(ids)
    }

    fn bpe_ids(&self, piece: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .bpe
            .encode(piece, false)
            .map_err(|e| TokenizerError::Backend(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// `messages` with every control token in their text marked as typed, not markup: render them
    /// and tokenise the result with [`Self::encode_within`] via [`RenderedPrompt::from_marked`].
    pub fn mark_messages(&self, messages: &[ChatMessage]) -> Vec<ChatMessage> {
        messages
            .iter()
            .map(|m| crate::literal::mark_message(&self.added, m))
            .collect()
    }

    /// Token ids of a prompt (control tokens parsed except where the prompt marks them literal),
    /// refused with [`TokenizerError::TooLong`] once it is sure to exceed `max_tokens`: at once
    /// when the text is longer than `max_tokens` of the longest token, else after counting at
    /// most about `max_tokens` tokens, so a huge prompt costs no more than a fitting one.
    pub fn encode_within(
        &self,
        prompt: &RenderedPrompt,
        max_tokens: usize,
    ) -> Result<Vec<u32>, TokenizerError> {
        let (text, literal_at) = (prompt.text(), prompt.literal_at());
        let too_long = || TokenizerError::TooLong { max_tokens };
        if text.len() > max_tokens.saturating_mul(self.max_token_len) {
            return Err(too_long());
        }
        // Every token spells at least one byte, so a text this short cannot exceed the bound.
        if text.len() >= max_tokens && self.count_exceeds(text, literal_at, max_tokens)? {
            return Err(too_long());
        }
        let ids = self.encode_except(text, true, literal_at)?;
        if ids.len() > max_tokens {
            return Err(too_long());
        }
        Ok(ids)
    }

    /// Token ids of plain text, as llama-server's `/tokenize` reads it: BOS first only with
    /// `add_special` (and a model that adds one); control tokens spelled in the text become
    /// their ids only with `parse_special`. Refused with [`TokenizerError::TooLong`] past
    /// `max_tokens`, counting no further than [`Self::encode_within`] does.
    pub fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
        max_tokens: usize,
    ) -> Result<Vec<u32>, TokenizerError> {
        let prompt = if parse_special {
            RenderedPrompt::plain(text)
        } else {
            RenderedPrompt::from_marked(&crate::literal::mark(&self.added, text))
        };
        let bos = usize::from(self.add_bos && self.bos_id.is_some());
        let mut ids = self.encode_within(&prompt, max_tokens.saturating_add(bos))?;
        if bos == 1 && !add_special {
            ids.remove(0);
        }
        Ok(ids)
    }

    /// Counts tokens piece by piece, stopping as soon as the count passes `max_tokens`. The pieces
    /// are cut where the split regex cuts anyway, so the count matches the full encoding.
    fn count_exceeds(
        &self,
        text: &str,
        literal_at: &[usize],
        max_tokens: usize,
    ) -> Result<bool, TokenizerError> {
        const MIN_PIECE: usize = 4096;
        let mut count = usize::from(self.add_bos && self.bos_id.is_some());
        for segment in self.added.split_except(text, true, literal_at) {
            let Segment::Text(piece) = segment else {
                count += 1;
                continue;
            };
            let mut from = 0;
            let cuts = crate::literal::piece_cuts(piece, MIN_PIECE);
            for to in cuts.into_iter().chain([piece.len()]) {
                count += self.bpe_ids(&piece[from..to])?.len();
                if count > max_tokens {
                    return Ok(true);
                }
                from = to;
            }
        }
        Ok(count > max_tokens)
    }

    /// Text of `ids`; invalid UTF-8 (a cut multi-byte char) becomes U+FFFD, as in transformers.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.check_ids(ids)?;
        let kept: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|&id| !(skip_special && self.is_control[id as usize]))
            .collect();
        self.bpe
            .decode(&kept, false)
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

    /// A control token (`<|im_end|>`): never spelled by text, dropped by `skip_special`.
    pub fn is_control(&self, id: u32) -> bool {
        self.is_control.get(id as usize).copied().unwrap_or(false)
    }

    /// `value` with every string in it marked as [`Self::mark_messages`] marks message text
    /// (tool definitions rendered into a prompt are client text too).
    pub fn mark_json(&self, value: &serde_json::Value) -> serde_json::Value {
        crate::literal::mark_json(&self.added, value)
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

/// Control tokens in the byte alphabet; those spelled outside it are llama.cpp mislabels, which
/// transformers skips too.
fn control_tokens(spec: &TokenizerSpec) -> impl Iterator<Item = &str> {
    spec.tokens
        .iter()
        .zip(&spec.token_types)
        .filter(|&(t, &ty)| ty == TokenType::Control as i32 && in_alphabet(t))
        .map(|(t, _)| t.as_str())
}

/// Control tokens and user-defined ones are both matched whole in the text; only control tokens
/// can be read as plain text instead. Each takes the id its spelling has in the BPE vocabulary (the
/// last of duplicates); a user-defined token whose spelling the vocabulary respelled is skipped.
fn added_tokens(spec: &TokenizerSpec, vocab: &Vocab) -> Result<AddedTokens, TokenizerError> {
    fn with_id<'s>(vocab: &Vocab, t: &'s str) -> Option<(&'s str, u32)> {
        vocab.get(t).map(|&id| (t, id))
    }
    let user = spec
        .tokens
        .iter()
        .zip(&spec.token_types)
        .filter(|&(_, &ty)| ty == TokenType::UserDefined as i32)
        .filter_map(|(t, _)| with_id(vocab, t));
    let control = control_tokens(spec).filter_map(|t| with_id(vocab, t));
    AddedTokens::new(control, user)
}

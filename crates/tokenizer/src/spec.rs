use serde::{Deserialize, Serialize};

/// llama.cpp's `llama_token_type` values, as stored in `tokenizer.ggml.token_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum TokenType {
    Undefined = 0,
    Normal = 1,
    Unknown = 2,
    Control = 3,
    UserDefined = 4,
    Unused = 5,
    Byte = 6,
}

/// The tokenizer a GGUF file describes, field for field (`tokenizer.ggml.*`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`; only "gpt2" (byte-level BPE) is supported.
    pub model: String,
    /// `tokenizer.ggml.pre`: which split regex the merges were learned with ("qwen2").
    pub pre: String,
    /// `tokenizer.ggml.tokens`, spelled in GPT-2's byte-to-unicode alphabet.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`, one per token (see [`TokenType`]).
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.merges`, "left right" pairs in rank order.
    pub merges: Vec<String>,
    pub bos_id: Option<u32>,
    pub eos_id: u32,
    pub pad_id: Option<u32>,
    pub add_bos: bool,
    pub chat_template: Option<String>,
}

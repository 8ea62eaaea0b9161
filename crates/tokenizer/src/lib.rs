//! Byte-level BPE tokenizer for GGUF models (Qwen3-MoE first), chat templates and reasoning split.
//!
//! The model crate turns `tokenizer.ggml.*` metadata into a [`TokenizerSpec`]; this crate never
//! reads GGUF itself. Behaviour mirrors Hugging Face transformers' GGUF tokenizer loader (our
//! correctness oracle, see `tools/tokenizer_parity`), which agrees with llama.cpp on Qwen3 files.

mod added;
mod bytes;
mod chat;
mod error;
mod limits;
mod literal;
mod pycompat;
mod pyjson;
mod reasoning;
mod renderer;
mod spec;
mod stream;
mod synthetic;
mod tokenizer;
pub mod worker;

pub use bytes::{byte_to_unicode, unicode_to_byte};
pub use chat::{ChatMessage, ChatTemplate, FunctionCall, ToolCall, QWEN3_CHAT_TEMPLATE};
pub use error::TokenizerError;
pub use limits::{TemplateLimit, TemplateLimits};
pub use literal::RenderedPrompt;
pub use reasoning::{split_reasoning, split_whole, thinking_switch, ReasoningSplitter, Split};
pub use renderer::{TemplateIsolation, TemplateOptions, TemplateRenderer};
pub use spec::{TokenType, TokenizerSpec};
pub use stream::StreamDecoder;
pub use synthetic::{
    synthetic_spec, QWEN3_ADDED_TOKENS, QWEN3_BPE_TOKENS, QWEN3_VOCAB_SIZE, SYNTHETIC_MIN_VOCAB,
};
pub use tokenizer::Tokenizer;
pub use worker::{run_template_worker, WorkerCommand};

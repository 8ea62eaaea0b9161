//! The GGUF reader and everything that reads a header: `parse_header`, a write-back round trip
//! through `GgufWriter`, `Model::load` (config, tensor binding, tokenizer metadata) and the
//! tokenizer the file describes.

use std::path::{Path, PathBuf};

use q4moe_gguf::{parse_header, GgufError, GgufHeader, GgufWriter};
use q4moe_model::{spec_from_gguf, Model};
use q4moe_tokenizer::Tokenizer;

use super::Target;
use crate::FuzzError;

pub struct Gguf {
    /// `Model::load` reads a path: each input is written here first.
    path: PathBuf,
}

impl Gguf {
    pub fn new(scratch: &Path) -> Result<Self, FuzzError> {
        std::fs::create_dir_all(scratch).map_err(|e| FuzzError::io(scratch, e))?;
        let path = scratch.join(format!("gguf-{}.gguf", std::process::id()));
        Ok(Self { path })
    }
}

impl Drop for Gguf {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

const DICT: &[&[u8]] = &[
    b"GGUF",
    b"general.architecture",
    b"general.alignment",
    b"qwen3moe",
    b"qwen3moe.block_count",
    b"qwen3moe.embedding_length",
    b"qwen3moe.attention.head_count",
    b"qwen3moe.attention.head_count_kv",
    b"qwen3moe.expert_count",
    b"qwen3moe.expert_used_count",
    b"tokenizer.ggml.tokens",
    b"tokenizer.ggml.merges",
    b"tokenizer.ggml.token_type",
    b"tokenizer.ggml.eos_token_id",
    b"tokenizer.chat_template",
    b"token_embd.weight",
    b"output.weight",
    b"blk.0.ffn_gate_exps.weight",
    b"<|im_start|>",
    b"\x09\0\0\0",
    b"\x08\0\0\0",
];

impl Target for Gguf {
    fn name(&self) -> &'static str {
        "gguf"
    }

    fn max_len(&self) -> usize {
        96 << 10
    }

    fn dict(&self) -> &'static [&'static [u8]] {
        DICT
    }

    fn run(&mut self, input: &[u8]) -> Result<String, String> {
        let header = match parse_header(input) {
            Ok(h) => h,
            Err(e) => return Ok(format!("header: {}", class(&e))),
        };
        round_trip(&header)?;
        let tokenizer = match spec_from_gguf(&header, "fuzz") {
            Ok(spec) => tokenizer_outcome(Tokenizer::from_spec(&spec))?,
            Err(e) => format!("spec: {e}"),
        };
        std::fs::write(&self.path, input).map_err(|e| format!("scratch file: {e}"))?;
        let model = match Model::load(&self.path) {
            Ok(m) => format!("loaded {} layers", m.layers.len()),
            Err(e) => format!("model: {e}"),
        };
        Ok(format!("{tokenizer} / {model}"))
    }
}

/// A header error's kind, without the names a mutant garbles (so that they do not all count as
/// new outcomes).
fn class(e: &GgufError) -> String {
    let tail = |msg: &str| {
        let msg = msg.rsplit(": ").next().unwrap_or(msg);
        msg.split(['[', '('])
            .next()
            .unwrap_or(msg)
            .trim()
            .to_string()
    };
    match e {
        GgufError::Io { .. } => "io".into(),
        GgufError::BadMagic(_) => "bad magic".into(),
        GgufError::BadVersion(_) => "bad version".into(),
        GgufError::Truncated { .. } => "truncated".into(),
        GgufError::Absurd { .. } => "absurd count".into(),
        GgufError::UnknownType(_) => "unknown type".into(),
        GgufError::Metadata { msg, .. } => format!("metadata {}", tail(msg)),
        GgufError::Tensor { msg, .. } => format!("tensor {}", tail(msg)),
        GgufError::Other(msg) => format!("other {}", tail(msg)),
    }
}

/// What the reader accepted, the writer writes back, and the reader reads the same again.
fn round_trip(h: &GgufHeader) -> Result<(), String> {
    // Tensors may overlap in a file; rewriting them packed could take far more than its size.
    let data: u64 = h.tensors.iter().map(|t| t.n_bytes().unwrap_or(0)).sum();
    if data > 8 << 20 {
        return Ok(());
    }
    let dir = h
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.dims.clone(), t.ggml_type))
        .collect();
    let refused = |e| format!("the writer refused what the reader accepted: {e}");
    let mut w = GgufWriter::new(Vec::new(), &h.metadata, dir).map_err(refused)?;
    for t in &h.tensors {
        let n = t.n_bytes().map_err(refused)? as usize;
        w.write_tensor_data(&t.name, &vec![0; n]).map_err(refused)?;
    }
    let bytes = w.finish().map_err(refused)?;
    let back = parse_header(&bytes).map_err(|e| format!("the written file does not parse: {e}"))?;
    // Debug text compares NaN payload-free floats equal, as a round trip should.
    if format!("{:?}", back.metadata) != format!("{:?}", h.metadata) {
        return Err("metadata changed in a write-read round trip".into());
    }
    let shape = |h: &GgufHeader| -> Vec<_> {
        h.tensors
            .iter()
            .map(|t| (t.name.clone(), t.dims.clone(), t.ggml_type))
            .collect()
    };
    if shape(&back) != shape(h) {
        return Err("the tensor directory changed in a write-read round trip".into());
    }
    Ok(())
}

/// A tokenizer the file describes encodes to ids inside its vocabulary, which decode.
fn tokenizer_outcome(
    tok: Result<Tokenizer, q4moe_tokenizer::TokenizerError>,
) -> Result<String, String> {
    let tok = match tok {
        Ok(t) => t,
        Err(e) => return Ok(format!("tokenizer: {e}")),
    };
    let text = "Hello wörld 😀\n<|im_start|>user<think>";
    // A hostile vocabulary may lack byte tokens: an error is fine, a wrong id is not.
    let ids = match tok.encode(text, false) {
        Ok(ids) => ids,
        Err(e) => return Ok(format!("encode: {e}")),
    };
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= tok.vocab_size()) {
        return Err(format!(
            "encode produced id {bad} >= vocab {}",
            tok.vocab_size()
        ));
    }
    tok.decode(&ids, false)
        .map_err(|e| format!("decode of encoded ids failed: {e}"))?;
    Ok(format!("tokenizer of {} tokens", tok.vocab_size().min(1)))
}

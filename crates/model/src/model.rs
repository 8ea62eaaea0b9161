//! Tensor bindings: every weight the forward pass reads, resolved once by name and checked
//! against `Config`, as byte ranges into the memory-mapped file.

use std::ops::Range;
use std::path::Path;

use q4moe_gguf::{GgmlType, GgufFile};
use q4moe_tokenizer::TokenizerSpec;

use crate::{Config, ModelError, Result};

/// A weight tensor in the file. `dims` in GGUF order: `dims[0]` is the row (input) length.
#[derive(Debug, Clone)]
pub struct QTensor {
    pub name: String,
    pub ty: GgmlType,
    pub dims: Vec<usize>,
    /// Absolute byte range in the file.
    pub range: Range<usize>,
}

impl QTensor {
    /// Elements per row (the contiguous dimension).
    pub fn row_len(&self) -> usize {
        self.dims[0]
    }
    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.ty
            .row_bytes(self.dims[0])
            .expect("row length validated at load")
    }
    /// Rows in one 2-D slab (`dims[1]`); for 3-D expert tensors, rows per expert.
    pub fn rows(&self) -> usize {
        self.dims.get(1).copied().unwrap_or(1)
    }
    /// Bytes of one 2-D slab (one expert of an `_exps` tensor).
    pub fn slab_bytes(&self) -> usize {
        self.rows() * self.row_bytes()
    }
    pub fn n_bytes(&self) -> usize {
        self.range.len()
    }
}

/// One transformer block's weights. Shapes in GGUF order ([in, out] / [in, out, expert]).
#[derive(Debug, Clone)]
pub struct LayerTensors {
    /// [d_model] f32
    pub attn_norm: QTensor,
    /// [d_model, q_dim]
    pub attn_q: QTensor,
    /// [d_model, kv_dim]
    pub attn_k: QTensor,
    /// [d_model, kv_dim]
    pub attn_v: QTensor,
    /// [q_dim, d_model]
    pub attn_output: QTensor,
    /// [head_dim] f32
    pub attn_q_norm: QTensor,
    /// [head_dim] f32
    pub attn_k_norm: QTensor,
    /// [d_model] f32
    pub ffn_norm: QTensor,
    /// [d_model, n_expert] router
    pub ffn_gate_inp: QTensor,
    /// [d_model, d_ff_expert, n_expert]
    pub ffn_gate_exps: QTensor,
    /// [d_model, d_ff_expert, n_expert]
    pub ffn_up_exps: QTensor,
    /// [d_ff_expert, d_model, n_expert]
    pub ffn_down_exps: QTensor,
}

impl LayerTensors {
    /// Bytes of one expert's weights (its gate, up and down slabs).
    pub fn expert_bytes(&self) -> usize {
        [&self.ffn_gate_exps, &self.ffn_up_exps, &self.ffn_down_exps]
            .iter()
            .map(|t| t.slab_bytes())
            .sum()
    }
}

/// A loaded model: the mapping, its geometry and every tensor binding. Immutable and shareable;
/// session state (KV, scratch, setup caches) lives in the backends.
pub struct Model {
    pub config: Config,
    pub file: GgufFile,
    /// [d_model, vocab]
    pub token_embd: QTensor,
    /// [d_model] f32
    pub output_norm: QTensor,
    /// [d_model, vocab]; the token embedding when the file has no separate head (tied).
    pub output: QTensor,
    pub layers: Vec<LayerTensors>,
    pub tokenizer: TokenizerSpec,
}

impl Model {
    pub fn load(path: impl AsRef<Path>) -> Result<Model> {
        let file = GgufFile::open(path.as_ref())?;
        let fname = path.as_ref().display().to_string();
        let config = Config::from_gguf(&file.header, &fname)?;
        let b = Binder {
            file: &file,
            fname: &fname,
        };
        let (c, d) = (&config, config.d_model);
        let token_embd = b.bind("token_embd.weight", &[d, c.vocab_size], false)?;
        let output = match file.header.tensor_info("output.weight") {
            Some(_) => b.bind("output.weight", &[d, c.vocab_size], false)?,
            None => token_embd.clone(),
        };
        let output_norm = b.bind("output_norm.weight", &[d], true)?;
        let layers = (0..c.n_layer)
            .map(|i| b.layer(c, i))
            .collect::<Result<Vec<_>>>()?;
        let tokenizer = crate::spec_from_gguf(&file.header, &fname)?;
        if tokenizer.tokens.len() > c.vocab_size {
            return Err(ModelError::Key {
                file: fname,
                key: "tokenizer.ggml.tokens".into(),
                msg: format!(
                    "has {} tokens but the embedding has only {} rows",
                    tokenizer.tokens.len(),
                    c.vocab_size
                ),
            });
        }
        Ok(Model {
            config,
            file,
            token_embd,
            output_norm,
            output,
            layers,
            tokenizer,
        })
    }

    /// The bytes of a tensor.
    pub fn data(&self, t: &QTensor) -> &[u8] {
        &self.file.bytes()[t.range.clone()]
    }

    /// One row of a 2-D tensor (or of the whole flattened 3-D tensor).
    pub fn row(&self, t: &QTensor, row: usize) -> &[u8] {
        let rb = t.row_bytes();
        &self.data(t)[row * rb..(row + 1) * rb]
    }

    /// One expert's slab of a 3-D `_exps` tensor.
    pub fn expert(&self, t: &QTensor, expert: usize) -> &[u8] {
        let sb = t.slab_bytes();
        &self.data(t)[expert * sb..(expert + 1) * sb]
    }

    /// A 1-D f32 tensor (norm weights) as floats, dequantising if stored otherwise.
    pub fn vector_f32(&self, t: &QTensor) -> Vec<f32> {
        let mut out = vec![0f32; t.dims.iter().product()];
        q4moe_gguf::quant::dequantize_row(t.ty, self.data(t), &mut out)
            .expect("type validated at load");
        out
    }

    /// Bytes of weights one decode step reads: attention, router, the used experts and the head.
    pub fn bytes_per_token(&self) -> u64 {
        let c = &self.config;
        let per_layer = |l: &LayerTensors| {
            let attn = [
                &l.attn_q,
                &l.attn_k,
                &l.attn_v,
                &l.attn_output,
                &l.ffn_gate_inp,
            ]
            .iter()
            .map(|t| t.n_bytes())
            .sum::<usize>();
            (attn + l.expert_bytes() * c.n_expert_used) as u64
        };
        self.layers.iter().map(per_layer).sum::<u64>()
            + self.output.n_bytes() as u64
            + self.token_embd.row_bytes() as u64
    }

    /// Total bytes of tensor data.
    pub fn weight_bytes(&self) -> u64 {
        self.file
            .tensors()
            .iter()
            .filter_map(|t| t.n_bytes().ok())
            .sum()
    }
}

struct Binder<'a> {
    file: &'a GgufFile,
    fname: &'a str,
}

impl Binder<'_> {
    fn err(&self, tensor: &str, msg: impl Into<String>) -> ModelError {
        ModelError::Tensor {
            file: self.fname.into(),
            tensor: tensor.into(),
            msg: msg.into(),
        }
    }

    fn bind(&self, name: &str, dims: &[usize], is_norm: bool) -> Result<QTensor> {
        let view = self
            .file
            .tensor(name)
            .ok_or_else(|| self.err(name, "missing from the file"))?;
        let info = view.info;
        let got: Vec<usize> = info.dims.iter().map(|&d| d as usize).collect();
        if got != dims {
            return Err(self.err(name, format!("has shape {got:?}, expected {dims:?}")));
        }
        if !info.ggml_type.is_supported() {
            return Err(self.err(
                name,
                format!("has unsupported quant type {}", info.ggml_type),
            ));
        }
        if is_norm
            && !matches!(
                info.ggml_type,
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16
            )
        {
            return Err(self.err(
                name,
                format!(
                    "is a norm vector stored as {}, expected F32",
                    info.ggml_type
                ),
            ));
        }
        let start = self.file.header.data_offset as usize + info.offset as usize;
        Ok(QTensor {
            name: name.into(),
            ty: info.ggml_type,
            dims: got,
            range: start..start + view.data.len(),
        })
    }

    fn layer(&self, c: &Config, i: usize) -> Result<LayerTensors> {
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        let (d, q, kv, e, f) = (c.d_model, c.q_dim(), c.kv_dim(), c.n_expert, c.d_ff_expert);
        Ok(LayerTensors {
            attn_norm: self.bind(&n("attn_norm"), &[d], true)?,
            attn_q: self.bind(&n("attn_q"), &[d, q], false)?,
            attn_k: self.bind(&n("attn_k"), &[d, kv], false)?,
            attn_v: self.bind(&n("attn_v"), &[d, kv], false)?,
            attn_output: self.bind(&n("attn_output"), &[q, d], false)?,
            attn_q_norm: self.bind(&n("attn_q_norm"), &[c.head_dim], true)?,
            attn_k_norm: self.bind(&n("attn_k_norm"), &[c.head_dim], true)?,
            ffn_norm: self.bind(&n("ffn_norm"), &[d], true)?,
            ffn_gate_inp: self.bind(&n("ffn_gate_inp"), &[d, e], false)?,
            ffn_gate_exps: self.bind(&n("ffn_gate_exps"), &[d, f, e], false)?,
            ffn_up_exps: self.bind(&n("ffn_up_exps"), &[d, f, e], false)?,
            ffn_down_exps: self.bind(&n("ffn_down_exps"), &[f, d, e], false)?,
        })
    }
}

impl Model {
    /// Touches every page of the mapping (in parallel) so the first tokens do not pay for disk
    /// reads; shows a progress bar for large files.
    pub fn prefault(&self, progress: bool) {
        use rayon::prelude::*;
        const CHUNK: usize = 64 << 20;
        let bytes = self.file.bytes();
        let bar = if progress && bytes.len() > 1 << 30 {
            let b = indicatif::ProgressBar::new(bytes.len() as u64);
            b.set_style(
                indicatif::ProgressStyle::with_template("loading {bar:40} {bytes}/{total_bytes}")
                    .expect("static template"),
            );
            b
        } else {
            indicatif::ProgressBar::hidden()
        };
        bytes.par_chunks(CHUNK).for_each(|c| {
            let mut acc = 0u8;
            for page in c.chunks(4096) {
                acc ^= page[0];
            }
            std::hint::black_box(acc);
            bar.inc(c.len() as u64);
        });
        bar.finish_and_clear();
    }
}

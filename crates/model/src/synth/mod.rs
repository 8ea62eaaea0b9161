//! `q4moe synth`: a GGUF with random weights for a named geometry, laid out exactly as
//! llama.cpp's converter writes a real Qwen3-MoE file (names, shapes, metadata, tokenizer).

mod blocks;

use std::io::BufWriter;
use std::path::Path;

use q4moe_gguf::{GgmlType, GgufWriter, Value};
use rayon::prelude::*;

use crate::sampling::Rng;
use crate::{Config, ModelError, Result};

/// Quantisation recipes, named as llama.cpp names the file types.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SynthQuant {
    Q4_0,
    Q4_K,
    /// llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for the output head and for attn_v and
    /// ffn_down_exps on the layers its `use_more_bits` picks (half of them).
    Q4_K_M,
    Q8_0,
}

impl SynthQuant {
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "q4_0" => Ok(Self::Q4_0),
            "q4_k" | "q4_k_s" => Ok(Self::Q4_K),
            "q4_k_m" => Ok(Self::Q4_K_M),
            "q8_0" => Ok(Self::Q8_0),
            other => Err(ModelError::Invalid(format!(
                "unknown quant '{other}' (known: q4_0, q4_k, q4_k_m, q8_0)"
            ))),
        }
    }

    /// `general.file_type` (llama_ftype).
    fn file_type(self) -> u32 {
        match self {
            Self::Q4_0 => 2,
            Self::Q8_0 => 7,
            Self::Q4_K => 14,
            Self::Q4_K_M => 15,
        }
    }

    fn base(self) -> GgmlType {
        match self {
            Self::Q4_0 => GgmlType::Q4_0,
            Self::Q8_0 => GgmlType::Q8_0,
            Self::Q4_K | Self::Q4_K_M => GgmlType::Q4_K,
        }
    }
}

/// llama.cpp's `use_more_bits(i_layer, n_layers)`.
fn use_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// One tensor to write: name, GGUF dims, type and the weights' standard deviation.
struct Plan {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    std: f32,
    /// Norm vectors: values near 1 rather than near 0.
    is_norm: bool,
}

fn plan(c: &Config, q: SynthQuant) -> Vec<Plan> {
    let base = q.base();
    let mat = |name: String, dims: Vec<usize>, ty: GgmlType, std: f32| Plan {
        name,
        dims: dims.into_iter().map(|d| d as u64).collect(),
        ty,
        std,
        is_norm: false,
    };
    let norm = |name: String, n: usize| Plan {
        name,
        dims: vec![n as u64],
        ty: GgmlType::F32,
        std: 0.1,
        is_norm: true,
    };
    let (d, inv_d) = (c.d_model, 1.0 / (c.d_model as f32).sqrt());
    let head_ty = if q == SynthQuant::Q4_K_M {
        GgmlType::Q6_K
    } else {
        base
    };
    let mut p = vec![
        mat("token_embd.weight".into(), vec![d, c.vocab_size], base, 1.0),
        norm("output_norm.weight".into(), d),
        mat(
            "output.weight".into(),
            vec![d, c.vocab_size],
            head_ty,
            3.0 * inv_d,
        ),
    ];
    for i in 0..c.n_layer {
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        let more = if q == SynthQuant::Q4_K_M && use_more_bits(i, c.n_layer) {
            GgmlType::Q6_K
        } else {
            base
        };
        p.push(norm(n("attn_norm"), d));
        p.push(mat(n("attn_q"), vec![d, c.q_dim()], base, inv_d));
        p.push(mat(n("attn_k"), vec![d, c.kv_dim()], base, inv_d));
        p.push(mat(n("attn_v"), vec![d, c.kv_dim()], more, inv_d));
        p.push(mat(
            n("attn_output"),
            vec![c.q_dim(), d],
            base,
            1.0 / (c.q_dim() as f32).sqrt(),
        ));
        p.push(norm(n("attn_q_norm"), c.head_dim));
        p.push(norm(n("attn_k_norm"), c.head_dim));
        p.push(norm(n("ffn_norm"), d));
        p.push(mat(
            n("ffn_gate_inp"),
            vec![d, c.n_expert],
            GgmlType::F32,
            4.0 * inv_d,
        ));
        p.push(mat(
            n("ffn_gate_exps"),
            vec![d, c.d_ff_expert, c.n_expert],
            base,
            inv_d,
        ));
        p.push(mat(
            n("ffn_up_exps"),
            vec![d, c.d_ff_expert, c.n_expert],
            base,
            inv_d,
        ));
        p.push(mat(
            n("ffn_down_exps"),
            vec![c.d_ff_expert, d, c.n_expert],
            more,
            1.0 / (c.d_ff_expert as f32).sqrt(),
        ));
    }
    p
}

/// What was written.
#[derive(Debug, Clone)]
pub struct SynthReport {
    pub bytes: u64,
    pub tensors: usize,
}

/// Bytes generated per parallel work unit (and per RNG stream): fixed so output is independent
/// of the thread count.
const CHUNK_BYTES: usize = 1 << 20;

/// Writes the model. Deterministic from `seed`; `progress` draws a bar on stderr.
pub fn write(
    path: &Path,
    c: &Config,
    q: SynthQuant,
    seed: u64,
    progress: bool,
) -> Result<SynthReport> {
    c.validate()
        .map_err(|m| ModelError::Invalid(format!("invalid geometry: {m}")))?;
    let min_vocab = q4moe_tokenizer::SYNTHETIC_MIN_VOCAB;
    if c.vocab_size < min_vocab {
        return Err(ModelError::Invalid(format!(
            "invalid geometry: vocab_size {} is below {min_vocab}, the smallest synthetic vocabulary",
            c.vocab_size
        )));
    }
    let plans = plan(c, q);
    check_tensor_sizes(&plans)?;
    let spec = q4moe_tokenizer::synthetic_spec(c.vocab_size, seed);
    let mut meta = c.to_metadata();
    meta.insert(
        1,
        (
            "general.name".into(),
            Value::String(format!(
                "q4moe synthetic {} seed {seed}",
                c.arch.gguf_name()
            )),
        ),
    );
    meta.push(("general.file_type".into(), Value::U32(q.file_type())));
    meta.push(("general.quantization_version".into(), Value::U32(2)));
    meta.extend(crate::spec_to_metadata(&spec));
    let io = |e| ModelError::Io {
        path: path.display().to_string(),
        error: e,
    };
    let file = std::fs::File::create(path).map_err(io)?;
    let dir = plans
        .iter()
        .map(|p| (p.name.clone(), p.dims.clone(), p.ty))
        .collect();
    let mut w = GgufWriter::new(BufWriter::with_capacity(8 << 20, file), &meta, dir)?;
    let total: u64 = w.tensors().iter().map(|t| t.n_bytes().unwrap_or(0)).sum();
    let bar = progress_bar(progress, total);
    for (ti, p) in plans.iter().enumerate() {
        let bytes = generate(p, seed, ti as u64);
        w.write_tensor_data(&p.name, &bytes)?;
        bar.inc(bytes.len() as u64);
    }
    let out = w.finish()?;
    out.into_inner()
        .map_err(|e| io(e.into_error()))?
        .sync_all()
        .map_err(io)?;
    bar.finish_and_clear();
    Ok(SynthReport {
        bytes: std::fs::metadata(path).map_err(io)?.len(),
        tensors: plans.len(),
    })
}

/// Each tensor is generated in memory whole.
const MAX_TENSOR_BYTES: u64 = 4 << 30;

fn check_tensor_sizes(plans: &[Plan]) -> Result<()> {
    for p in plans {
        let elems = p.dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
        let bytes = elems.map(|n| n / p.ty.block_size() as u64 * p.ty.type_size() as u64);
        if bytes.is_none_or(|b| b > MAX_TENSOR_BYTES) {
            return Err(ModelError::Invalid(format!(
                "tensor {} of shape {:?} would exceed {MAX_TENSOR_BYTES} bytes; pick smaller dimensions",
                p.name, p.dims
            )));
        }
        let row = p.dims[0] as usize;
        if !row.is_multiple_of(p.ty.block_size()) {
            return Err(ModelError::Invalid(format!(
                "tensor {}: row length {row} is not a multiple of the {} block size {}; pick dimensions that are",
                p.name,
                p.ty,
                p.ty.block_size()
            )));
        }
    }
    Ok(())
}

fn progress_bar(show: bool, total: u64) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "writing {bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("static template"),
    );
    bar
}

/// Generates one tensor's bytes in parallel, one RNG stream per fixed-size chunk.
fn generate(p: &Plan, seed: u64, tensor_index: u64) -> Vec<u8> {
    let info = q4moe_gguf::TensorInfo {
        name: p.name.clone(),
        dims: p.dims.clone(),
        ggml_type: p.ty,
        offset: 0,
    };
    let n = info.n_bytes().expect("checked block sizes") as usize;
    let mut bytes = vec![0u8; n];
    let chunk = CHUNK_BYTES / p.ty.type_size() * p.ty.type_size();
    bytes
        .par_chunks_mut(chunk)
        .enumerate()
        .for_each(|(ci, out)| {
            let mut rng = Rng::new(
                seed ^ tensor_index.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    ^ (ci as u64).wrapping_mul(0xD1B5_4A32_D192_ED03),
            );
            blocks::fill(p.ty, p.std, &mut rng, out);
            if p.is_norm {
                for v in out.chunks_exact_mut(4) {
                    let x = 1.0 + f32::from_le_bytes(v.try_into().expect("4 bytes"));
                    v.copy_from_slice(&x.to_le_bytes());
                }
            }
        });
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_k_m_upgrades_half_the_layers_like_llama_cpp() {
        let n = 48;
        assert_eq!((0..n).filter(|&i| use_more_bits(i, n)).count(), 24);
    }
}

//! Geometry of a Qwen3-MoE model, read once from GGUF metadata (keys as llama.cpp writes them).

use q4moe_gguf::{GgufHeader, Value};

use crate::{ModelError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    Qwen3Moe,
}

impl Arch {
    pub fn gguf_name(self) -> &'static str {
        match self {
            Arch::Qwen3Moe => "qwen3moe",
        }
    }
}

/// One model's geometry. Derived sizes are methods so they can never disagree with the source.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub arch: Arch,
    pub n_layer: usize,
    pub d_model: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// Hidden size of one expert's FFN.
    pub d_ff_expert: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    /// Renormalise the top-k router weights to sum to one (Qwen3-MoE: true).
    pub norm_topk_prob: bool,
}

impl Config {
    /// Query projection width, `n_head * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }
    /// Key/value projection width, `n_kv_head * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_head * self.head_dim
    }
    /// Query heads per KV head.
    pub fn n_group(&self) -> usize {
        self.n_head / self.n_kv_head
    }

    /// Qwen3-30B-A3B.
    pub fn qwen3_30b_a3b() -> Self {
        Config {
            arch: Arch::Qwen3Moe,
            n_layer: 48,
            d_model: 2048,
            n_head: 32,
            n_kv_head: 4,
            head_dim: 128,
            n_expert: 128,
            n_expert_used: 8,
            d_ff_expert: 768,
            vocab_size: 151936,
            context_length: 40960,
            rms_eps: 1e-6,
            rope_theta: 1e6,
            norm_topk_prob: true,
        }
    }

    /// For tests: every row a multiple of 256 so Q4_K/Q6_K apply, two KV groups, 8 experts of which 2 used.
    pub fn tiny() -> Self {
        Config {
            n_layer: 2,
            d_model: 256,
            n_head: 4,
            n_kv_head: 2,
            head_dim: 64,
            n_expert: 8,
            n_expert_used: 2,
            d_ff_expert: 256,
            vocab_size: 1024,
            context_length: 512,
            ..Self::qwen3_30b_a3b()
        }
    }

    /// Mid-size: several KV groups, real head_dim, more experts (GPU parity, oracle's second geometry).
    pub fn mid() -> Self {
        Config {
            n_layer: 4,
            d_model: 1024,
            n_head: 16,
            n_kv_head: 4,
            head_dim: 128,
            n_expert: 32,
            n_expert_used: 4,
            d_ff_expert: 512,
            vocab_size: 4096,
            context_length: 4096,
            ..Self::qwen3_30b_a3b()
        }
    }

    pub fn geometry(name: &str) -> Result<Self> {
        match name {
            "tiny" => Ok(Self::tiny()),
            "mid" => Ok(Self::mid()),
            "qwen3-30b-a3b" => Ok(Self::qwen3_30b_a3b()),
            other => Err(ModelError::Invalid(format!(
                "unknown geometry '{other}' (known: tiny, mid, qwen3-30b-a3b)"
            ))),
        }
    }

    /// Checks the invariants the kernels rely on.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let positive = [
            ("block_count", self.n_layer),
            ("embedding_length", self.d_model),
            ("attention.head_count", self.n_head),
            ("attention.head_count_kv", self.n_kv_head),
            ("attention.key_length", self.head_dim),
            ("expert_count", self.n_expert),
            ("expert_used_count", self.n_expert_used),
            ("expert_feed_forward_length", self.d_ff_expert),
            ("vocab_size", self.vocab_size),
            ("context_length", self.context_length),
        ];
        if let Some((k, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{k} must be positive"));
        }
        if !self.n_head.is_multiple_of(self.n_kv_head) {
            return Err(format!(
                "head_count {} is not a multiple of head_count_kv {}",
                self.n_head, self.n_kv_head
            ));
        }
        if self.n_expert_used > self.n_expert {
            return Err(format!(
                "expert_used_count {} exceeds expert_count {}",
                self.n_expert_used, self.n_expert
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head dimension {} must be even for RoPE",
                self.head_dim
            ));
        }
        if !(self.rms_eps > 0.0
            && self.rms_eps.is_finite()
            && self.rope_theta > 0.0
            && self.rope_theta.is_finite())
        {
            return Err("rms epsilon and rope theta must be positive and finite".into());
        }
        // Far above any released model; they keep products like q_dim and buffer sizes from
        // overflowing or asking for absurd memory.
        let limits = [
            ("block_count", self.n_layer, 4096),
            ("embedding_length", self.d_model, 1 << 16),
            ("attention.head_count", self.n_head, 1024),
            ("attention.key_length", self.head_dim, 1024),
            ("expert_count", self.n_expert, 65536),
            ("expert_feed_forward_length", self.d_ff_expert, 1 << 18),
            ("vocab_size", self.vocab_size, 1 << 21),
            ("context_length", self.context_length, 1 << 24),
        ];
        if let Some((k, v, l)) = limits.iter().find(|(_, v, l)| v > l) {
            return Err(format!("{k} = {v} is beyond the supported limit {l}"));
        }
        Ok(())
    }

    /// Reads and validates the geometry. `vocab_size` comes from the token embedding's shape
    /// (what llama.cpp trusts), falling back to `<arch>.vocab_size`.
    pub fn from_gguf(h: &GgufHeader, file: &str) -> Result<Self> {
        let arch_name = h
            .get("general.architecture")
            .and_then(Value::as_str)
            .ok_or_else(|| ModelError::Key {
                file: file.into(),
                key: "general.architecture".into(),
                msg: "missing or not a string".into(),
            })?;
        let arch = match arch_name {
            "qwen3moe" => Arch::Qwen3Moe,
            other => {
                return Err(ModelError::Unsupported {
                    file: file.into(),
                    msg: format!(
                        "architecture '{other}' is not supported (q4moe supports: qwen3moe)"
                    ),
                })
            }
        };
        let meta = Meta {
            h,
            file,
            prefix: arch_name,
        };
        let n_head = meta.usize("attention.head_count")?;
        let d_model = meta.usize("embedding_length")?;
        let head_dim = meta.usize_or("attention.key_length", d_model / n_head.max(1))?;
        let vocab_size = match h.tensor_info("token_embd.weight") {
            Some(t) if t.dims.len() == 2 => t.dims[1] as usize,
            _ => meta.usize("vocab_size")?,
        };
        let cfg = Config {
            arch,
            n_layer: meta.usize("block_count")?,
            d_model,
            n_head,
            n_kv_head: meta.usize_or("attention.head_count_kv", n_head)?,
            head_dim,
            n_expert: meta.usize("expert_count")?,
            n_expert_used: meta.usize("expert_used_count")?,
            d_ff_expert: meta.usize("expert_feed_forward_length")?,
            vocab_size,
            context_length: meta.usize("context_length")?,
            rms_eps: meta.f32("attention.layer_norm_rms_epsilon")?,
            rope_theta: meta.f32_or("rope.freq_base", 10000.0)?,
            norm_topk_prob: true,
        };
        let value_length = meta.usize_or("attention.value_length", head_dim)?;
        if value_length != head_dim {
            return Err(meta.err(
                "attention.value_length",
                format!("{value_length} differs from key_length {head_dim}"),
            ));
        }
        cfg.validate()
            .map_err(|msg| ModelError::Invalid(format!("{file}: invalid geometry: {msg}")))?;
        Ok(cfg)
    }

    /// Metadata keys as llama.cpp's converter writes them for this architecture.
    pub fn to_metadata(&self) -> Vec<(String, Value)> {
        let p = self.arch.gguf_name();
        let u = |k: &str, v: usize| (format!("{p}.{k}"), Value::U32(v as u32));
        vec![
            ("general.architecture".into(), Value::String(p.into())),
            u("context_length", self.context_length),
            u("embedding_length", self.d_model),
            u("feed_forward_length", self.d_ff_expert * self.n_expert_used),
            u("block_count", self.n_layer),
            u("attention.head_count", self.n_head),
            u("attention.head_count_kv", self.n_kv_head),
            u("attention.key_length", self.head_dim),
            u("attention.value_length", self.head_dim),
            (format!("{p}.rope.freq_base"), Value::F32(self.rope_theta)),
            (
                format!("{p}.attention.layer_norm_rms_epsilon"),
                Value::F32(self.rms_eps),
            ),
            u("expert_used_count", self.n_expert_used),
            u("expert_count", self.n_expert),
            u("expert_feed_forward_length", self.d_ff_expert),
        ]
    }
}

struct Meta<'a> {
    h: &'a GgufHeader,
    file: &'a str,
    prefix: &'a str,
}

impl Meta<'_> {
    fn err(&self, key: &str, msg: impl Into<String>) -> ModelError {
        ModelError::Key {
            file: self.file.into(),
            key: format!("{}.{key}", self.prefix),
            msg: msg.into(),
        }
    }
    fn get(&self, key: &str) -> Option<&Value> {
        self.h.get(&format!("{}.{key}", self.prefix))
    }
    fn usize(&self, key: &str) -> Result<usize> {
        let v = self.get(key).ok_or_else(|| self.err(key, "missing"))?;
        v.as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| self.err(key, format!("{v:?} is not a non-negative integer")))
    }
    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        if self.get(key).is_none() {
            return Ok(default);
        }
        self.usize(key)
    }
    fn f32(&self, key: &str) -> Result<f32> {
        let v = self.get(key).ok_or_else(|| self.err(key, "missing"))?;
        v.as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| self.err(key, format!("{v:?} is not a number")))
    }
    fn f32_or(&self, key: &str, default: f32) -> Result<f32> {
        if self.get(key).is_none() {
            return Ok(default);
        }
        self.f32(key)
    }
}

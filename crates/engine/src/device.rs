use std::sync::Arc;

use q4moe_cpu::{CpuBackend, Precision};
use q4moe_cuda::{CudaBackend, CudaOptions};
use q4moe_model::backend::{Backend, KvType};
use q4moe_model::Model;
use q4moe_tokenizer::TemplateOptions;

use crate::{EngineError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The GPU when one is usable, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

impl Device {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda),
            other => Err(EngineError::Invalid(format!(
                "unknown device '{other}' (auto, cpu, cuda)"
            ))),
        }
    }
}

#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub device: Device,
    /// Positions each session may hold (clamped to the model's context length).
    pub kv_capacity: usize,
    /// How the KV cache stores keys and values (both backends round alike).
    pub kv_type: KvType,
    /// Bound on the bytes of KV every session holds together (`--kv-cache-mb`), the running
    /// sequences' and the idle sessions kept for prefix reuse alike (kept ones are dropped,
    /// least recently used first, when a running one needs room): on the CPU the pool its pages
    /// come from; on CUDA, whose sessions each hold their own allocation (doubling as they
    /// grow), the sum of those (`CudaOptions::kv_pool_bytes`).
    pub kv_cache_bytes: usize,
    /// How the CPU backend multiplies activations by the quantised weights: Q8 (activations
    /// quantised as llama.cpp does, the default) or Exact (f32 activations, the float
    /// reference the oracle tests hold to transformers).
    pub cpu_precision: Precision,
    /// The CUDA backend's options (setup cache, in-flight steps, prefill chunk, kernel
    /// profile and the tunables of `--cuda-opt`). Its `kv_capacity` and `kv_type` are taken
    /// from the fields above when the backend opens.
    pub cuda: CudaOptions,
    /// The chat template's limits and where it renders (in process by default; front ends
    /// serving untrusted model files render in workers, which bound memory and time too).
    pub template: TemplateOptions,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            device: Device::Auto,
            kv_capacity: 4096,
            kv_type: KvType::default(),
            kv_cache_bytes: 4 << 30,
            cpu_precision: Precision::Q8,
            cuda: CudaOptions::default(),
            template: TemplateOptions::default(),
        }
    }
}

pub fn open_backend(model: Arc<Model>, opts: &EngineOptions) -> Result<Box<dyn Backend>> {
    let kv_capacity = opts.kv_capacity.min(model.config.context_length);
    let cuda_opts = || CudaOptions {
        in_flight: opts.cuda.in_flight.max(1),
        kv_capacity,
        kv_type: opts.kv_type,
        kv_pool_bytes: opts.kv_cache_bytes,
        ..opts.cuda.clone()
    };
    let cpu = || {
        CpuBackend::with_precision(model.clone(), kv_capacity, opts.cpu_precision)
            .with_kv_type(opts.kv_type)
            .with_kv_pool(opts.kv_cache_bytes)
    };
    match opts.device {
        Device::Cpu => Ok(Box::new(cpu())),
        Device::Cuda => match q4moe_cuda::cuda_available() {
            Ok(_) => Ok(Box::new(CudaBackend::new(model, cuda_opts())?)),
            Err(why) => Err(EngineError::Invalid(format!(
                "--device cuda was asked for but CUDA is not usable: {why}"
            ))),
        },
        Device::Auto => match q4moe_cuda::cuda_available() {
            Ok(_) => Ok(Box::new(CudaBackend::new(model, cuda_opts())?)),
            Err(_) => Ok(Box::new(cpu())),
        },
    }
}

//! Helpers the GPU tests share (kernels.rs, moe_kernels.rs, matrix_parity.rs).
#![allow(dead_code)]

use q4moe_cuda::testing::TestDevice;
use q4moe_gguf::GgmlType;
use q4moe_model::sampling::Rng;

/// Fails the test, saying why, where no GPU is usable (these tests run only when asked).
pub fn require_gpu() {
    if let Err(why) = q4moe_cuda::cuda_available() {
        panic!("this test needs a CUDA GPU: {why}");
    }
}

/// The device, or a failure that says why there is none (these tests run only when asked).
pub fn device() -> TestDevice {
    require_gpu();
    TestDevice::new().expect("CUDA is available but the device did not start")
}

pub fn randn(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.next_f32() * 2.0 - 1.0) * scale + 0.01)
        .collect()
}

pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let r = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * r * w).collect()
}

/// Every weight type the kernels read.
pub const EVERY_TYPE: [GgmlType; 6] = [
    GgmlType::Q4_0,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::F32,
    GgmlType::F16,
];

//! Issue 55 item 3: weights holding NaN (here the output norm) used to make the CPU backend
//! sample garbage and succeed; non-finite logits are now an error naming the position.

use std::path::Path;
use std::sync::Arc;

use q4moe_cpu::CpuBackend;
use q4moe_gguf::{GgufFile, GgufWriter};
use q4moe_model::backend::{Backend, BatchOut, BatchRow, DecodeRequest, Flow, Logits};
use q4moe_model::sampling::SamplingParams;
use q4moe_model::synth::{self, SynthQuant};
use q4moe_model::{Config, Model};

/// The tiny synthetic model with every `output_norm.weight` element set to `value`.
fn poisoned_model(dir: &Path, value: f32) -> Arc<Model> {
    let src = dir.join("tiny.gguf");
    synth::write(&src, &Config::tiny(), SynthQuant::Q4_K_M, 3, false).unwrap();
    let f = GgufFile::open(&src).unwrap();
    let decl = f
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), t.dims.clone(), t.ggml_type))
        .collect();
    let out = dir.join("poisoned.gguf");
    let file = std::fs::File::create(&out).unwrap();
    let mut w = GgufWriter::new(file, &f.header.metadata, decl).unwrap();
    for t in f.tensors() {
        let mut data = f.tensor(&t.name).unwrap().data.to_vec();
        if t.name == "output_norm.weight" {
            for v in data.chunks_mut(4) {
                v.copy_from_slice(&value.to_le_bytes());
            }
        }
        w.write_tensor_data(&t.name, &data).unwrap();
    }
    w.finish().unwrap();
    Arc::new(Model::load(&out).unwrap())
}

fn expect_non_finite<T: std::fmt::Debug>(r: Result<T, impl std::fmt::Display>, position: usize) {
    let e = r.map(|_| ()).unwrap_err().to_string();
    assert!(
        e.contains("non-finite logits") && e.contains(&format!("position {position}")),
        "{e}"
    );
}

#[test]
fn nan_or_infinite_weights_are_an_error_on_prefill_and_decode() {
    for value in [f32::NAN, f32::INFINITY] {
        let dir = tempfile::tempdir().unwrap();
        let mut b = CpuBackend::new(poisoned_model(dir.path(), value), 64);
        expect_non_finite(b.prefill(1, &[1, 2, 3], Logits::Last), 2);
        expect_non_finite(b.prefill(2, &[1, 2, 3], Logits::All), 0);
        let sampling = SamplingParams::greedy();
        let req = DecodeRequest {
            session: 3,
            first_token: 5,
            max_tokens: 4,
            sampling: &sampling,
            history: &[],
            want_logits: false,
        };
        let mut emitted = 0;
        let r = b.decode(&req, &mut |_| {
            emitted += 1;
            Flow::Continue
        });
        expect_non_finite(r, 0);
        assert_eq!(emitted, 0, "no token may come from non-finite logits");
        b.prefill(4, &[1, 2], Logits::None).unwrap();
        let mut rows = [
            BatchRow {
                session: 5,
                token: 7,
                sampler: None,
                logits: true,
            },
            BatchRow {
                session: 4,
                token: 3,
                sampler: None,
                logits: true,
            },
        ];
        expect_non_finite(b.step_batch(&mut rows, &mut BatchOut::default()), 0);
    }
}

//! The binary seeds of the `gguf` corpus, written by `q4moe-fuzz seeds` (the text seeds of the
//! other targets are plain files, edited by hand). Each stays small: a whole micro model (one
//! layer, 32-wide, 314 tokens, Q8_0) is about 40 KB.

use std::path::Path;

use q4moe_gguf::{GgmlType, GgufWriter, Value, ValueType};
use q4moe_model::synth::{self, SynthQuant};
use q4moe_model::{spec_to_metadata, Config};
use q4moe_tokenizer::{synthetic_spec, SYNTHETIC_MIN_VOCAB};

use crate::FuzzError;

/// The smallest geometry `Config::validate` accepts with a grouped-query layout and routing.
pub fn micro_config() -> Config {
    Config {
        n_layer: 1,
        d_model: 32,
        n_head: 2,
        n_kv_head: 1,
        head_dim: 16,
        n_expert: 4,
        n_expert_used: 2,
        d_ff_expert: 32,
        vocab_size: SYNTHETIC_MIN_VOCAB,
        context_length: 64,
        ..Config::tiny()
    }
}

/// Writes every generated seed into `dir` (the `gguf` corpus folder).
pub fn write_gguf_seeds(dir: &Path) -> Result<Vec<String>, FuzzError> {
    std::fs::create_dir_all(dir).map_err(|e| FuzzError::io(dir, e))?;
    let model = dir.join("micro_model_q8_0.gguf");
    synth::write(&model, &micro_config(), SynthQuant::Q8_0, 0, false)
        .map_err(|e| FuzzError::Worker(format!("synth: {e}")))?;
    let spec = synthetic_spec(SYNTHETIC_MIN_VOCAB, 0);
    let mut tokenizer_meta = vec![(
        "general.architecture".to_string(),
        Value::String("qwen3moe".into()),
    )];
    tokenizer_meta.extend(spec_to_metadata(&spec));
    write(&dir.join("tokenizer_only.gguf"), &tokenizer_meta, &[])?;
    write(
        &dir.join("every_value_type.gguf"),
        &every_value(),
        &tensors(),
    )?;
    write(&dir.join("empty.gguf"), &[], &[])?;
    Ok(vec![
        "micro_model_q8_0.gguf".into(),
        "tokenizer_only.gguf".into(),
        "every_value_type.gguf".into(),
        "empty.gguf".into(),
    ])
}

/// One key of each metadata type, nested arrays and an explicit alignment.
fn every_value() -> Vec<(String, Value)> {
    let s = |x: &str| Value::String(x.into());
    vec![
        ("general.alignment".into(), Value::U32(64)),
        ("u8".into(), Value::U8(7)),
        ("i8".into(), Value::I8(-7)),
        ("u16".into(), Value::U16(700)),
        ("i16".into(), Value::I16(-700)),
        ("u32".into(), Value::U32(70000)),
        ("i32".into(), Value::I32(-70000)),
        ("f32".into(), Value::F32(1.5)),
        ("bool".into(), Value::Bool(true)),
        ("string".into(), s("wörld 😀")),
        ("u64".into(), Value::U64(1 << 40)),
        ("i64".into(), Value::I64(-(1 << 40))),
        ("f64".into(), Value::F64(-2.25)),
        (
            "array".into(),
            Value::Array(ValueType::String, vec![s("a"), s("<|im_start|>")]),
        ),
        (
            "nested".into(),
            Value::Array(
                ValueType::Array,
                vec![Value::Array(
                    ValueType::U8,
                    vec![Value::U8(1), Value::U8(2)],
                )],
            ),
        ),
    ]
}

fn tensors() -> Vec<(String, Vec<u64>, GgmlType)> {
    vec![
        ("f32".into(), vec![8], GgmlType::F32),
        ("f16".into(), vec![4, 2], GgmlType::F16),
        ("q4_0".into(), vec![32, 2], GgmlType::Q4_0),
        ("q8_0".into(), vec![32, 1, 1], GgmlType::Q8_0),
    ]
}

fn write(
    path: &Path,
    meta: &[(String, Value)],
    tensors: &[(String, Vec<u64>, GgmlType)],
) -> Result<(), FuzzError> {
    let err = |e: q4moe_gguf::GgufError| FuzzError::Worker(format!("{}: {e}", path.display()));
    let mut w = GgufWriter::new(Vec::new(), meta, tensors.to_vec()).map_err(err)?;
    for (name, _, _) in tensors {
        let info = w
            .tensors()
            .iter()
            .find(|t| &t.name == name)
            .expect("declared");
        let n = info.n_bytes().map_err(err)? as usize;
        let data: Vec<u8> = (0..n).map(|i| (i * 37 % 251) as u8).collect();
        w.write_tensor_data(name, &data).map_err(err)?;
    }
    let bytes = w.finish().map_err(err)?;
    std::fs::write(path, bytes).map_err(|e| FuzzError::io(path, e))
}

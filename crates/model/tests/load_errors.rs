//! A model file that is wrong in any way the loader checks fails with an error naming the
//! key or tensor; a good synthetic file loads with the geometry it was written with.

use std::path::{Path, PathBuf};

use q4moe_gguf::{GgmlType, GgufFile, GgufWriter, Value};
use q4moe_model::synth::{self, SynthQuant};
use q4moe_model::{Config, Model};

type Tensor = (String, Vec<u64>, GgmlType, Vec<u8>);

fn tiny(dir: &Path) -> PathBuf {
    let p = dir.join("tiny.gguf");
    synth::write(&p, &Config::tiny(), SynthQuant::Q4_K_M, 1, false).unwrap();
    p
}

/// Copies `src` to a new file after letting `edit` change the metadata and tensors.
fn rewrite(
    src: &Path,
    dir: &Path,
    edit: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<Tensor>),
) -> PathBuf {
    let f = GgufFile::open(src).unwrap();
    let mut meta = f.header.metadata.clone();
    let mut tensors: Vec<Tensor> = f
        .tensors()
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.dims.clone(),
                t.ggml_type,
                f.tensor(&t.name).unwrap().data.to_vec(),
            )
        })
        .collect();
    edit(&mut meta, &mut tensors);
    let out = dir.join("edited.gguf");
    let dirs = tensors
        .iter()
        .map(|(n, d, t, _)| (n.clone(), d.clone(), *t))
        .collect();
    let mut w = GgufWriter::new(std::fs::File::create(&out).unwrap(), &meta, dirs).unwrap();
    for (n, _, _, data) in &tensors {
        w.write_tensor_data(n, data).unwrap();
    }
    w.finish().unwrap();
    out
}

fn load_err(path: &Path) -> String {
    match Model::load(path) {
        Ok(_) => panic!("{} loaded but should not have", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn synthetic_model_loads_with_its_geometry_and_q4_k_m_mix() {
    let dir = tempfile::tempdir().unwrap();
    let m = Model::load(tiny(dir.path())).unwrap();
    assert_eq!(m.config, Config::tiny());
    assert_eq!(m.output.ty, GgmlType::Q6_K);
    assert_eq!(
        m.layers[1].attn_v.ty,
        GgmlType::Q6_K,
        "layer 1 of 2 uses more bits"
    );
    assert_eq!(m.layers[0].attn_v.ty, GgmlType::Q4_K);
    assert_eq!(m.layers[0].attn_q.ty, GgmlType::Q4_K);
    assert_eq!(m.tokenizer.tokens.len(), Config::tiny().vocab_size);
    assert!(m.bytes_per_token() < m.weight_bytes());
}

#[test]
fn missing_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = rewrite(&tiny(dir.path()), dir.path(), |_, t| {
        t.retain(|x| x.0 != "blk.1.ffn_up_exps.weight")
    });
    let e = load_err(&p);
    assert!(
        e.contains("blk.1.ffn_up_exps.weight") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn wrong_shape_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = rewrite(&tiny(dir.path()), dir.path(), |_, t| {
        let x = t
            .iter_mut()
            .find(|x| x.0 == "blk.0.attn_k_norm.weight")
            .unwrap();
        x.1 = vec![32];
        x.3.truncate(32 * 4);
    });
    let e = load_err(&p);
    assert!(
        e.contains("blk.0.attn_k_norm.weight") && e.contains("shape"),
        "{e}"
    );
}

#[test]
fn unsupported_architecture_and_missing_key_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let src = tiny(dir.path());
    let p = rewrite(&src, dir.path(), |m, _| {
        m.iter_mut()
            .find(|(k, _)| k == "general.architecture")
            .unwrap()
            .1 = Value::String("llama".into());
    });
    let e = load_err(&p);
    assert!(e.contains("llama") && e.contains("not supported"), "{e}");
    let p = rewrite(&src, dir.path(), |m, _| {
        m.retain(|(k, _)| k != "qwen3moe.expert_used_count")
    });
    let e = load_err(&p);
    assert!(
        e.contains("qwen3moe.expert_used_count") && e.contains("missing"),
        "{e}"
    );
    let p = rewrite(&src, dir.path(), |m, _| {
        m.iter_mut()
            .find(|(k, _)| k == "qwen3moe.expert_used_count")
            .unwrap()
            .1 = Value::U32(99);
    });
    assert!(load_err(&p).contains("expert_used_count"));
    let p = rewrite(&src, dir.path(), |m, _| {
        m.iter_mut()
            .find(|(k, _)| k == "qwen3moe.block_count")
            .unwrap()
            .1 = Value::String("two".into());
    });
    assert!(load_err(&p).contains("qwen3moe.block_count"));
}

#[test]
fn unsupported_quant_type_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = rewrite(&tiny(dir.path()), dir.path(), |_, t| {
        let x = t.iter_mut().find(|x| x.0 == "blk.0.attn_q.weight").unwrap();
        // Same byte count per 256 weights as Q4_K would not hold; Q5_K is 176 bytes per block.
        x.2 = GgmlType::Q5_K;
        x.3 = vec![0x11; x.3.len() / 144 * 176];
    });
    let e = load_err(&p);
    assert!(
        e.contains("blk.0.attn_q.weight") && e.contains("Q5_K"),
        "{e}"
    );
}

#[test]
fn synth_is_deterministic_from_the_seed() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        dir.path().join("a"),
        dir.path().join("b"),
        dir.path().join("c"),
    );
    synth::write(&a, &Config::tiny(), SynthQuant::Q4_0, 5, false).unwrap();
    synth::write(&b, &Config::tiny(), SynthQuant::Q4_0, 5, false).unwrap();
    synth::write(&c, &Config::tiny(), SynthQuant::Q4_0, 6, false).unwrap();
    let read = |p: &Path| std::fs::read(p).unwrap();
    assert_eq!(read(&a), read(&b));
    assert_ne!(read(&a), read(&c));
}

#[test]
fn synth_rejects_dimensions_that_do_not_fit_the_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config {
        d_model: 96,
        ..Config::tiny()
    };
    let e = synth::write(&dir.path().join("x.gguf"), &cfg, SynthQuant::Q4_K, 0, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("block size"), "{e}");
}

/// Issue 55 item 5: a key written twice is refused, naming the key.
#[test]
fn duplicate_metadata_key_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let src = tiny(dir.path());
    let p = rewrite(&src, dir.path(), |m, _| {
        m.push(("qwen3moe.block_count".into(), Value::U32(1)));
    });
    let e = load_err(&p);
    assert!(
        e.contains("qwen3moe.block_count") && e.contains("twice"),
        "{e}"
    );
}

/// A `tracing` writer that keeps what it is given.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Issue 55 item 5: an optional key of the wrong type still loads (the default serves) but is
/// never silent: a warning names the key, the type expected and the type found.
#[test]
fn mistyped_optional_keys_warn() {
    let dir = tempfile::tempdir().unwrap();
    let src = tiny(dir.path());
    let p = rewrite(&src, dir.path(), |m, _| {
        for (k, v) in m.iter_mut() {
            match k.as_str() {
                "tokenizer.ggml.add_bos_token" => *v = Value::String("yes".into()),
                "tokenizer.chat_template" => *v = Value::U32(3),
                _ => {}
            }
        }
    });
    let log = Captured::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let model = tracing::subscriber::with_default(subscriber, || Model::load(&p)).unwrap();
    assert!(!model.tokenizer.add_bos && model.tokenizer.chat_template.is_none());
    let log = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
    for want in [
        "tokenizer.ggml.add_bos_token: expected a bool, found String",
        "tokenizer.chat_template: expected a string, found U32",
    ] {
        assert!(
            log.contains(want) && log.contains("WARN"),
            "{want} not in {log}"
        );
    }
}

//! GGUF container: write -> read round trips, and hostile or broken files (must return Err,
//! never panic, never allocate what the header merely claims).

use q4moe_gguf::{
    parse_header, quant, GgmlType, GgufError, GgufFile, GgufWriter, Value, ValueType,
};
use rand::{rngs::StdRng, Rng, SeedableRng};

fn all_values() -> Vec<(String, Value)> {
    let s = |v: &str| Value::String(v.to_string());
    vec![
        ("general.architecture".into(), s("qwen3moe")),
        ("t.u8".into(), Value::U8(200)),
        ("t.i8".into(), Value::I8(-100)),
        ("t.u16".into(), Value::U16(60000)),
        ("t.i16".into(), Value::I16(-30000)),
        ("t.u32".into(), Value::U32(4_000_000_000)),
        ("t.i32".into(), Value::I32(-2_000_000_000)),
        ("t.f32".into(), Value::F32(1.5e-6)),
        ("t.bool".into(), Value::Bool(true)),
        ("t.string".into(), s("héllo \u{1F600}")),
        ("t.empty_string".into(), s("")),
        ("t.u64".into(), Value::U64(u64::MAX - 3)),
        ("t.i64".into(), Value::I64(i64::MIN + 5)),
        ("t.f64".into(), Value::F64(-2.5e-300)),
        (
            "t.strings".into(),
            Value::string_array(["a", "", "ĠThe", "<|im_end|>"].map(String::from)),
        ),
        (
            "t.i32s".into(),
            Value::Array(
                ValueType::I32,
                vec![Value::I32(1), Value::I32(-2), Value::I32(3)],
            ),
        ),
        ("t.empty".into(), Value::Array(ValueType::F32, vec![])),
        (
            "t.nested".into(),
            Value::Array(
                ValueType::Array,
                vec![
                    Value::Array(ValueType::U8, vec![Value::U8(1), Value::U8(2)]),
                    Value::Array(ValueType::String, vec![s("x"), s("yz")]),
                ],
            ),
        ),
    ]
}

struct Tensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: Vec<u8>,
}

fn tensors(rng: &mut StdRng) -> Vec<Tensor> {
    let specs: [(&str, &[u64], GgmlType); 7] = [
        ("token_embd.weight", &[256, 3], GgmlType::Q4_K),
        ("blk.0.attn_norm.weight", &[33], GgmlType::F32),
        ("blk.0.ffn_gate_exps.weight", &[64, 2, 2], GgmlType::Q4_0),
        ("blk.0.ffn_down_exps.weight", &[256, 2], GgmlType::Q6_K),
        ("blk.0.attn_q.weight", &[32, 5], GgmlType::Q8_0),
        ("blk.0.attn_k.weight", &[7, 3], GgmlType::F16),
        ("output.weight", &[9], GgmlType::BF16),
    ];
    specs
        .iter()
        .map(|&(name, dims, ty)| {
            let n: u64 = dims.iter().product();
            let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
            let mut data = Vec::new();
            quant::quantize_row(ty, &x, &mut data).unwrap();
            Tensor {
                name: name.into(),
                dims: dims.to_vec(),
                ty,
                data,
            }
        })
        .collect()
}

fn write(meta: &[(String, Value)], ts: &[Tensor]) -> Vec<u8> {
    let decl = ts
        .iter()
        .map(|t| (t.name.clone(), t.dims.clone(), t.ty))
        .collect();
    let mut w = GgufWriter::new(Vec::new(), meta, decl).unwrap();
    for t in ts {
        // In two pieces, to exercise streaming.
        let (a, b) = t.data.split_at(t.data.len() / 2);
        w.write_tensor_data(&t.name, a).unwrap();
        w.write_tensor_data(&t.name, b).unwrap();
    }
    w.finish().unwrap()
}

fn sample_file() -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(11);
    write(&all_values(), &tensors(&mut rng))
}

#[test]
fn round_trip_every_value_type_and_tensor_type() {
    for alignment in [None, Some(64u32), Some(1)] {
        let mut rng = StdRng::seed_from_u64(12);
        let mut meta = all_values();
        if let Some(a) = alignment {
            meta.push(("general.alignment".into(), Value::U32(a)));
        }
        let ts = tensors(&mut rng);
        let bytes = write(&meta, &ts);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        std::fs::write(&path, &bytes).unwrap();
        let f = GgufFile::open(&path).unwrap();
        let al = alignment.unwrap_or(32) as u64;
        assert_eq!(f.header.alignment, al);
        assert_eq!(f.header.data_offset % al, 0);
        assert_eq!(f.header.metadata, meta);
        for (k, v) in &meta {
            assert_eq!(f.get(k), Some(v), "{k}");
        }
        assert_eq!(f.tensors().len(), ts.len());
        for t in &ts {
            let v = f.tensor(&t.name).unwrap();
            assert_eq!(
                (v.info.dims.as_slice(), v.info.ggml_type),
                (t.dims.as_slice(), t.ty),
                "{}",
                t.name
            );
            assert_eq!(v.info.offset % al, 0, "{} offset", t.name);
            assert_eq!(v.data, t.data.as_slice(), "{}", t.name);
        }
        assert!(f.tensor("missing").is_none());
        assert_eq!(bytes.len() as u64 % al, 0, "file padded to alignment");
    }
}

#[test]
fn writer_rejects_misuse() {
    let decl = vec![
        ("a".to_string(), vec![32u64], GgmlType::F32),
        ("b".to_string(), vec![32u64], GgmlType::Q4_0),
    ];
    let mut w = GgufWriter::new(Vec::new(), &[], decl.clone()).unwrap();
    assert!(w.write_tensor_data("b", &[0; 18]).is_err(), "out of order");
    assert!(w.write_tensor_data("a", &[0; 129]).is_err(), "too long");
    w.write_tensor_data("a", &[0; 128]).unwrap();
    assert!(w.finish().is_err(), "b never written");
    let bad = vec![("x".to_string(), vec![33u64], GgmlType::Q4_0)];
    assert!(
        GgufWriter::new(Vec::new(), &[], bad).is_err(),
        "not whole blocks"
    );
    let meta = vec![("general.alignment".to_string(), Value::U32(0))];
    assert!(
        GgufWriter::new(Vec::new(), &meta, decl.clone()).is_err(),
        "alignment 0"
    );
    let meta = vec![("general.alignment".to_string(), Value::U32(48))];
    assert!(
        GgufWriter::new(Vec::new(), &meta, decl.clone()).is_err(),
        "alignment not a power of two"
    );
    let meta = vec![(
        "m".to_string(),
        Value::Array(ValueType::U8, vec![Value::U16(1)]),
    )];
    assert!(
        GgufWriter::new(Vec::new(), &meta, decl).is_err(),
        "mixed array"
    );
}

#[test]
fn truncated_files_fail_cleanly() {
    let bytes = sample_file();
    let h = parse_header(&bytes).unwrap();
    let header_end = h.data_offset as usize;
    // Trailing alignment padding may be cut; any byte of tensor data may not.
    let data_end = h
        .tensors
        .iter()
        .map(|t| header_end + (t.offset + t.n_bytes().unwrap()) as usize)
        .max()
        .unwrap();
    assert!(parse_header(&bytes[..data_end]).is_ok());
    // Every cut inside the header, then a stride through the data.
    let cuts = (0..header_end).chain((header_end..data_end).step_by(7));
    for cut in cuts {
        assert!(
            parse_header(&bytes[..cut]).is_err(),
            "cut at {cut} of {} parsed",
            bytes.len()
        );
    }
}

fn u64_at(buf: &mut [u8], off: usize, v: u64) {
    buf[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

#[test]
fn bad_magic_and_version() {
    let mut b = sample_file();
    b[0] = b'X';
    assert!(matches!(parse_header(&b), Err(GgufError::BadMagic(_))));
    for v in [0u32, 1, 4, u32::MAX] {
        let mut b = sample_file();
        b[4..8].copy_from_slice(&v.to_le_bytes());
        assert!(matches!(parse_header(&b), Err(GgufError::BadVersion(x)) if x == v));
    }
}

#[test]
fn absurd_counts_and_lengths_fail_fast() {
    let base = sample_file();
    let t0 = std::time::Instant::now();
    for (off, v) in [
        (8, u64::MAX),
        (8, 1 << 40),
        (16, u64::MAX),
        (16, 1 << 30),
        (8, 1000),
        (16, 1000),
    ] {
        let mut b = base.clone();
        u64_at(&mut b, off, v);
        let e = parse_header(&b).unwrap_err();
        if v > 1000 {
            assert!(
                matches!(e, GgufError::Absurd { .. }),
                "count {v} at {off}: {e}"
            );
        }
    }
    // First key's length, then the string array's length.
    let mut b = base.clone();
    u64_at(&mut b, 24, u64::MAX / 2);
    assert!(parse_header(&b).is_err());
    let pos = find(&base, b"t.strings") + b"t.strings".len() + 4 + 4;
    for v in [u64::MAX, 1 << 50, 1 << 20] {
        let mut b = base.clone();
        u64_at(&mut b, pos, v);
        assert!(parse_header(&b).is_err(), "array length {v}");
    }
    assert!(
        t0.elapsed().as_secs_f64() < 1.0,
        "hostile headers must fail fast"
    );
}

fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len())
        .position(|w| w == needle)
        .expect("needle present")
}

/// Offset of a tensor's directory `offset` field (the last 8 bytes of its entry).
fn tensor_offset_field(b: &[u8], name: &str, n_dims: usize) -> usize {
    find(b, name.as_bytes()) + name.len() + 4 + 8 * n_dims + 4
}

#[test]
fn tensor_extents_are_checked() {
    let base = sample_file();
    let off = tensor_offset_field(&base, "output.weight", 1);
    let mut b = base.clone();
    u64_at(&mut b, off, 1 << 20);
    let e = parse_header(&b).unwrap_err().to_string();
    assert!(
        e.contains("output.weight") && e.contains("past the end"),
        "{e}"
    );
    let mut b = base.clone();
    u64_at(&mut b, off, u64::MAX - 31);
    assert!(parse_header(&b).is_err(), "offset overflow");
    let mut b = base.clone();
    let cur = u64::from_le_bytes(b[off..off + 8].try_into().unwrap());
    u64_at(&mut b, off, cur + 2);
    let e = parse_header(&b).unwrap_err().to_string();
    assert!(e.contains("aligned"), "{e}");
    // Data cut short: the last tensor runs past the end.
    let end = parse_header(&base).unwrap().data_offset as usize + cur as usize + 10;
    assert!(parse_header(&base[..end]).is_err());
}

#[test]
fn duplicate_tensor_names_are_rejected() {
    let mut rng = StdRng::seed_from_u64(13);
    let mut ts = tensors(&mut rng);
    ts[1].name = ts[0].name.clone();
    let bytes = write(&all_values(), &ts);
    let e = parse_header(&bytes).unwrap_err().to_string();
    assert!(e.contains("twice"), "{e}");
}

#[test]
fn fuzz_byte_flips_never_panic() {
    let base = sample_file();
    let header_end = parse_header(&base).unwrap().data_offset as usize;
    let mut rng = StdRng::seed_from_u64(14);
    let mut ok = 0;
    for _ in 0..4000 {
        let mut b = base.clone();
        for _ in 0..rng.gen_range(1..4) {
            // Mostly in the header, where the parsing is.
            let i = if rng.gen_ratio(9, 10) {
                rng.gen_range(0..header_end)
            } else {
                rng.gen_range(0..b.len())
            };
            b[i] = match rng.gen_range(0..3) {
                0 => rng.gen(),
                1 => b[i] ^ (1 << rng.gen_range(0..8)),
                _ => 0xff,
            };
        }
        let len = if rng.gen_ratio(1, 8) {
            rng.gen_range(0..b.len())
        } else {
            b.len()
        };
        if let Ok(h) = parse_header(&b[..len]) {
            ok += 1;
            for t in &h.tensors {
                let start = (h.data_offset + t.offset) as usize;
                assert!(
                    start + t.n_bytes().unwrap() as usize <= len,
                    "{} escapes the file",
                    t.name
                );
            }
        }
    }
    assert!(
        ok > 0,
        "some flips (in string payloads, data) must still parse"
    );
}

#[test]
fn partial_blocks_are_named() {
    let base = sample_file();
    // token_embd is Q4_K [256, 3]: make its row 255 elements.
    let pos = find(&base, b"token_embd.weight") + "token_embd.weight".len() + 4;
    let mut b = base.clone();
    u64_at(&mut b, pos, 255);
    let e = parse_header(&b).unwrap_err().to_string();
    assert!(
        e.contains("token_embd.weight") && e.contains("block size"),
        "{e}"
    );
}

/// Issue 55 item 5: a key written twice used to be accepted, the last value silently winning.
#[test]
fn duplicate_metadata_keys_are_rejected() {
    let mut meta = all_values();
    let key = meta[2].0.clone();
    meta.push((key.clone(), Value::U32(7)));
    let bytes = write(&meta, &[]);
    let e = parse_header(&bytes).unwrap_err().to_string();
    assert!(e.contains(&key) && e.contains("twice"), "{e}");
}

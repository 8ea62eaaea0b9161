//! Bit-exact agreement with gguf-py (`gguf.quants` 0.19.0) on fixtures written by
//! tools/gguf_fixtures/make_fixtures.py.

use std::path::PathBuf;

use q4moe_gguf::quant;
use q4moe_gguf::GgmlType;

struct Fixture {
    name: String,
    kind: u32,
    ty: GgmlType,
    n: usize,
    /// Raw blocks (kind 0: input, kind 1: expected output).
    bytes: Vec<u8>,
    /// f32 values (kind 0: expected output, kind 1: input).
    floats: Vec<f32>,
}

fn load(name: &str) -> Fixture {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/quant")
        .join(name);
    let buf = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run tools/gguf_fixtures/make_fixtures.py)",
            path.display()
        )
    });
    assert_eq!(&buf[..4], b"Q4QF", "{name}: bad magic");
    let word = |i: usize| u32::from_le_bytes(buf[4 + 4 * i..8 + 4 * i].try_into().unwrap());
    assert_eq!(word(0), 1, "{name}: fixture version");
    let (kind, ty, n, n_bytes) = (
        word(1),
        GgmlType::from_id(word(2)).unwrap(),
        word(3) as usize,
        word(4) as usize,
    );
    let body = &buf[24..];
    assert_eq!(body.len(), n_bytes + 4 * n, "{name}: length");
    let (bytes, floats) = if kind == 0 {
        body.split_at(n_bytes)
    } else {
        let (f, b) = body.split_at(4 * n);
        (b, f)
    };
    let floats = floats
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    Fixture {
        name: name.into(),
        kind,
        ty,
        n,
        bytes: bytes.to_vec(),
        floats,
    }
}

const DEQUANT: [&str; 6] = ["q4_0", "q8_0", "q4_k", "q6_k", "f16", "bf16"];

#[test]
fn dequantize_matches_gguf_py_bit_exactly() {
    for t in DEQUANT {
        let f = load(&format!("dequant_{t}.bin"));
        assert_eq!(f.kind, 0);
        let mut out = vec![0f32; f.n];
        quant::dequantize_row(f.ty, &f.bytes, &mut out).unwrap();
        for (i, (a, b)) in out.iter().zip(&f.floats).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{}: element {i}: ours {a} vs gguf-py {b}",
                f.name
            );
        }
    }
}

#[test]
fn quantize_matches_gguf_py_bit_exactly() {
    for t in ["q4_0", "q8_0", "f16", "bf16"] {
        let f = load(&format!("quant_{t}.bin"));
        assert_eq!(f.kind, 1);
        let mut out = Vec::new();
        quant::quantize_row(f.ty, &f.floats, &mut out).unwrap();
        assert_eq!(out.len(), f.bytes.len(), "{}", f.name);
        if let Some(i) = out.iter().zip(&f.bytes).position(|(a, b)| a != b) {
            let bs = f.ty.type_size();
            panic!(
                "{}: first difference at byte {i} (block {}): ours {:?} vs gguf-py {:?}",
                f.name,
                i / bs,
                &out[i / bs * bs..(i / bs + 1) * bs],
                &f.bytes[i / bs * bs..(i / bs + 1) * bs]
            );
        }
    }
}

#[test]
fn vec_dot_paths_agree_on_fixture_rows() {
    use rand::{rngs::StdRng, Rng, SeedableRng};
    let mut rng = StdRng::seed_from_u64(7);
    for t in DEQUANT {
        let f = load(&format!("dequant_{t}.bin"));
        let x: Vec<f32> = (0..f.n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        let exact: f64 = f
            .floats
            .iter()
            .zip(&x)
            .map(|(w, x)| *w as f64 * *x as f64)
            .sum();
        let scale: f64 = f
            .floats
            .iter()
            .zip(&x)
            .map(|(w, x)| (*w as f64 * *x as f64).abs())
            .sum();
        for isa in quant::available_isas() {
            let got = quant::vec_dot_isa(isa, f.ty, &f.bytes, &x) as f64;
            assert!(
                (got - exact).abs() <= 1e-5 * scale,
                "{} {isa:?}: vec_dot {got} vs {exact}",
                f.name
            );
        }
        if matches!(f.ty, GgmlType::F16 | GgmlType::BF16) {
            continue;
        }
        let mut xq = Vec::new();
        quant::quantize_activation_q8(f.ty, &x, &mut xq);
        for isa in quant::available_isas() {
            let got = quant::vec_dot_q8_isa(isa, f.ty, &f.bytes, &xq) as f64;
            assert!(
                (got - exact).abs() <= 1e-2 * scale,
                "{} {isa:?}: vec_dot_q8 {got} vs {exact}",
                f.name
            );
        }
    }
}

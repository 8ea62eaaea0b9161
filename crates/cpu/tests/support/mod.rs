//! Golden-run fixture readers (formats: tools/oracle/make_fixtures.py, and matrix.rs's
//! tools/gguf_matrix/make_matrix.py), the checks a backend's logits and greedy tokens face
//! (check.rs), and a small SHA-256, so the tests need no dev-dependencies.
#![allow(dead_code)]

pub mod check;
pub mod matrix;

use std::path::{Path, PathBuf};

use q4moe_model::synth::SynthQuant;
use q4moe_model::Config;

pub const MAGIC: &[u8; 8] = b"Q4MORACL";
pub const VERSION: u32 = 1;

/// One oracle fixture: the synth parameters that regenerate its GGUF and the reference's run.
pub struct Fixture {
    pub name: String,
    pub config: Config,
    pub quant: SynthQuant,
    pub seed: u64,
    pub gguf_sha256: [u8; 32],
    pub golden: Golden,
}

/// The reference's run over one model: a prompt, its greedy continuation, every row's logits.
pub struct Golden {
    pub n_prompt: usize,
    pub n_gen: usize,
    /// [n_prompt + n_gen]: the prompt, then the reference's greedy tokens
    pub tokens: Vec<u32>,
    /// [n_rows, vocab] row i = logits after tokens[0..=i] (float64 reference, stored as f32)
    pub logits: Vec<f32>,
    pub vocab: usize,
    /// Smallest top1-top2 gap of the reference's greedy steps, relative to max |logit|.
    pub greedy_gap: f32,
    /// Smallest gap between the k-th and (k+1)-th router probability.
    pub router_gap: f32,
}

impl Golden {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.logits[i * self.vocab..(i + 1) * self.vocab]
    }
}

pub fn fixture_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/oracle")
        .join(format!("{name}.bin"))
}

pub struct Reader<'a>(pub &'a [u8], pub &'a str);

impl<'a> Reader<'a> {
    pub fn take(&mut self, n: usize) -> &'a [u8] {
        assert!(self.0.len() >= n, "{}: truncated fixture", self.1);
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().unwrap())
    }
    pub fn f32(&mut self) -> f32 {
        f32::from_le_bytes(self.take(4).try_into().unwrap())
    }
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take(8).try_into().unwrap())
    }
    pub fn f32s(&mut self, n: usize) -> Vec<f32> {
        self.take(n * 4)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }
    pub fn str(&mut self, n: usize) -> String {
        String::from_utf8_lossy(self.take(n))
            .trim_end_matches('\0')
            .to_string()
    }
}

pub fn load(name: &str) -> Fixture {
    let path = fixture_path(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let p = path.display().to_string();
    let mut r = Reader(&bytes, &p);
    assert_eq!(r.take(8), MAGIC, "{p}: not an oracle fixture");
    let version = r.u32();
    assert_eq!(
        version, VERSION,
        "{p}: fixture version {version}, test reads {VERSION}; rerun tools/oracle/make_fixtures.py"
    );
    let geometry = r.str(16);
    let quant = SynthQuant::parse(&r.str(8)).expect("fixture quant");
    let seed = r.u64();
    let mut config = Config::geometry(&geometry).expect("fixture geometry");
    read_dims(&mut r, &mut config);
    let gguf_sha256: [u8; 32] = r.take(32).try_into().unwrap();
    let golden = read_golden(&mut r, config.vocab_size);
    assert!(r.0.is_empty(), "{p}: trailing bytes");
    Fixture {
        name: name.into(),
        config,
        quant,
        seed,
        gguf_sha256,
        golden,
    }
}

/// The ten geometry fields both formats store, in this order, into `c`.
pub fn read_dims(r: &mut Reader, c: &mut Config) {
    let dims: Vec<usize> = (0..10).map(|_| r.u32() as usize).collect();
    for (dst, v) in [
        &mut c.n_layer,
        &mut c.d_model,
        &mut c.n_head,
        &mut c.n_kv_head,
        &mut c.head_dim,
        &mut c.n_expert,
        &mut c.n_expert_used,
        &mut c.d_ff_expert,
        &mut c.vocab_size,
        &mut c.context_length,
    ]
    .into_iter()
    .zip(dims)
    {
        *dst = v;
    }
}

/// The part of a fixture both formats share: counts, gaps, tokens, logits.
pub fn read_golden(r: &mut Reader, vocab_size: usize) -> Golden {
    let p = r.1.to_string();
    let (n_prompt, n_gen, n_rows, vocab, ref_bits) = (
        r.u32() as usize,
        r.u32() as usize,
        r.u32() as usize,
        r.u32() as usize,
        r.u32(),
    );
    assert_eq!(ref_bits, 64, "{p}: expected a float64 reference");
    assert_eq!(vocab, vocab_size, "{p}: vocab disagrees with the geometry");
    assert_eq!(n_rows, n_prompt + n_gen, "{p}: row count");
    let (greedy_gap, router_gap) = (r.f32(), r.f32());
    let tokens = (0..n_rows).map(|_| r.u32()).collect();
    let logits = r.f32s(n_rows * vocab);
    Golden {
        n_prompt,
        n_gen,
        tokens,
        logits,
        vocab,
        greedy_gap,
        router_gap,
    }
}

/// SHA-256 (FIPS 180-4), for checking the regenerated GGUF against the fixture's digest.
pub fn sha256(data: &[u8]) -> [u8; 32] {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    let mut h: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];
    let mut msg = data.to_vec();
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for block in msg.chunks_exact(64) {
        let mut w = [0u32; 64];
        for (i, b) in block.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes(b.try_into().unwrap());
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut hh] = h;
        for i in 0..64 {
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = hh
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & b) ^ (a & c) ^ (b & c);
            let t2 = s0.wrapping_add(maj);
            (hh, g, f, e, d, c, b, a) = (g, f, e, d.wrapping_add(t1), c, b, a, t1.wrapping_add(t2));
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d, e, f, g, hh]) {
            *x = x.wrapping_add(y);
        }
    }
    let mut out = [0u8; 32];
    out.chunks_exact_mut(4)
        .zip(h)
        .for_each(|(o, v)| o.copy_from_slice(&v.to_be_bytes()));
    out
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

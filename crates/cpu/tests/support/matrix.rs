//! Matrix fixtures (format: tools/gguf_matrix/make_matrix.py): a GGUF written by gguf-py and
//! the transformers float64 run over it, in tests/fixtures/matrix/<name>.{gguf,bin}.

use std::path::{Path, PathBuf};

use q4moe_model::Config;

use super::{read_dims, read_golden, Golden, Reader};

/// Calls `$m!` with the name of every matrix point (the fixtures tools/gguf_matrix writes): one
/// list for the CPU's and CUDA's matrix tests, each of which checks it against the fixtures.
#[macro_export]
macro_rules! matrix_points {
    ($m:ident) => {
        $m!(
            h64_g1_e8k1_q8_0,
            h64_g16_e64k8_d128_q4_0,
            h128_g8_e8k4_d128_q4_0,
            h128_g16_e8k2_d128_q4_0,
            h256_g2_e8k2_q6_k,
            h128_g2_e8k2_q4_k_m,
            h64_g4_e8k2_q4_k,
            h64_g2_e256k8_d64_q4_0,
            h64_g4_e8k2_d320_q4_0,
            h64_g2_e8k2_d512_q4_0,
            h64_g1_e8k8_d768_q4_0,
        );
    };
}

pub const MAGIC: &[u8; 8] = b"Q4MMATRX";
pub const VERSION: u32 = 1;

/// One matrix point: its GGUF, the geometry the script wrote into it, the reference's run.
pub struct Point {
    pub name: String,
    /// The quant mix (q4_0 | q8_0 | q4_k | q4_k_m | q6_k).
    pub mix: String,
    pub seed: u64,
    /// The geometry as the script wrote it (the loader must read the same from the file).
    pub config: Config,
    /// The file has no output.weight: the head is the token embedding.
    pub tied: bool,
    pub gguf: PathBuf,
    pub gguf_sha256: [u8; 32],
    pub golden: Golden,
    /// [n_gen] each reference greedy step's top1-top2 gap relative to its row's max |logit|.
    pub step_gaps: Vec<f32>,
}

/// tests/fixtures/matrix: beside the sources the test was built from, or, for a test binary
/// carried to another machine (dev/gpu-check.sh runs them from a copy's repository root),
/// under the working directory.
pub fn dir() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/matrix");
    let here = PathBuf::from("tests/fixtures/matrix");
    if built.is_dir() || !here.is_dir() {
        built
    } else {
        here
    }
}

/// A test file's points are exactly the fixtures: a point the script writes but no test names
/// would go unchecked.
#[allow(dead_code)] // the oracle's test files include this module too
pub fn assert_every_fixture_tested(points: &[&str]) {
    let mut tested: Vec<String> = points.iter().map(|s| s.to_string()).collect();
    tested.sort();
    assert_eq!(names(), tested);
}

/// Every point in the fixture directory, by name.
pub fn names() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir())
        .expect("tests/fixtures/matrix")
        .filter_map(|e| {
            let p = e.expect("directory entry").path();
            let bin = p.extension().is_some_and(|x| x == "bin");
            bin.then(|| p.file_stem().unwrap().to_string_lossy().into_owned())
        })
        .collect();
    v.sort();
    v
}

pub fn load(name: &str) -> Point {
    let path = dir().join(format!("{name}.bin"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let p = path.display().to_string();
    let mut r = Reader(&bytes, &p);
    assert_eq!(r.take(8), MAGIC, "{p}: not a matrix fixture");
    let version = r.u32();
    assert_eq!(
        version, VERSION,
        "{p}: fixture version {version}, test reads {VERSION}; rerun tools/gguf_matrix/make_matrix.py"
    );
    let stored_name = r.str(32);
    assert_eq!(stored_name, name, "{p}: holds point {stored_name}");
    let mix = r.str(16);
    let seed = r.u64();
    let mut config = Config::qwen3_30b_a3b();
    read_dims(&mut r, &mut config);
    let tied = r.u32() == 1;
    (config.rms_eps, config.rope_theta) = (r.f32(), r.f32());
    let gguf_sha256: [u8; 32] = r.take(32).try_into().unwrap();
    let golden = read_golden(&mut r, config.vocab_size);
    let step_gaps = r.f32s(golden.n_gen);
    assert!(r.0.is_empty(), "{p}: trailing bytes");
    Point {
        name: name.into(),
        mix,
        seed,
        config,
        tied,
        gguf: dir().join(format!("{name}.gguf")),
        gguf_sha256,
        golden,
        step_gaps,
    }
}

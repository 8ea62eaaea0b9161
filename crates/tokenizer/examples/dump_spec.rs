//! Prints `synthetic_spec(N, SEED)` as JSON (used by tools/tokenizer_parity/make_fixture.py).
//! Usage: cargo run -p q4moe-tokenizer --example dump_spec -- [N] [SEED] > spec.json

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args
        .next()
        .map_or(4096, |a| a.parse().expect("N must be an integer"));
    let seed: u64 = args
        .next()
        .map_or(0, |a| a.parse().expect("SEED must be an integer"));
    let t0 = std::time::Instant::now();
    let spec = q4moe_tokenizer::synthetic_spec(n, seed);
    eprintln!(
        "synthetic_spec({n}, {seed}): {} merges in {:?}",
        spec.merges.len(),
        t0.elapsed()
    );
    println!("{}", serde_json::to_string(&spec).expect("spec serializes"));
}

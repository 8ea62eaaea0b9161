//! Aggregate decode speed of the CPU backend's batched step (`Backend::step_batch`) at several
//! batch sizes, on a synthetic model: B greedy sequences of `--tokens` tokens each, after a
//! short prompt, timed `--reps` times (median, min, max). B = 1 through `decode` (the single
//! path) is the baseline; the CPU target is 4 sequences in under 2x the time of one.
//! Each figure comes in wall time and in the process's CPU time (all its threads; 10 ms ticks):
//! on a machine shared with other work, CPU time with `RAYON_NUM_THREADS=1` is the steadier.
//!
//! cargo run --release -p q4moe-cpu --example batch_decode -- [--geometry mid] [--layers N]
//!     [--vocab N] [--quant q4_0] [--tokens 64] [--batch 1,2,4,8] [--reps 5]

use std::sync::Arc;
use std::time::Instant;

use q4moe_cpu::CpuBackend;
use q4moe_model::backend::{Backend, BatchOut, BatchRow, DecodeRequest, Flow, Logits};
use q4moe_model::sampling::{argmax, SamplingParams};
use q4moe_model::synth::{self, SynthQuant};
use q4moe_model::{Config, Model};

struct Opts {
    geometry: String,
    layers: Option<usize>,
    vocab: Option<usize>,
    quant: String,
    tokens: usize,
    batch: Vec<usize>,
    reps: usize,
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts {
        geometry: "mid".into(),
        layers: None,
        vocab: None,
        quant: "q4_0".into(),
        tokens: 64,
        batch: vec![1, 2, 4, 8],
        reps: 5,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let [flag, value] = pair else {
            return Err(format!("{} needs a value", pair[0]));
        };
        let num = |v: &str| v.parse::<usize>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--geometry" => o.geometry = value.clone(),
            "--layers" => o.layers = Some(num(value)?),
            "--vocab" => o.vocab = Some(num(value)?),
            "--quant" => o.quant = value.clone(),
            "--tokens" => o.tokens = num(value)?,
            "--reps" => o.reps = num(value)?.max(1),
            "--batch" => o.batch = value.split(',').map(num).collect::<Result<_, _>>()?,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(o)
}

fn prompt(seq: usize, vocab: usize) -> Vec<u32> {
    (0..16)
        .map(|i| ((seq * 131 + i * 17 + 3) % vocab) as u32)
        .collect()
}

/// Seconds for `b` sequences of `tokens` greedy tokens each through `step_batch`.
fn time_batched(be: &mut CpuBackend, b: usize, tokens: usize) -> f64 {
    let vocab = be.config().vocab_size;
    let mut next: Vec<u32> = (0..b)
        .map(|s| argmax(&be.prefill(s as u64, &prompt(s, vocab), Logits::Last).unwrap()))
        .collect();
    let mut out = BatchOut::default();
    let t0 = Instant::now();
    for _ in 0..tokens {
        let mut rows: Vec<BatchRow<'_>> = (0..b)
            .map(|s| BatchRow {
                session: s as u64,
                token: next[s],
                sampler: None,
            })
            .collect();
        be.step_batch(&mut rows, &mut out).unwrap();
        next.iter_mut()
            .enumerate()
            .for_each(|(s, t)| *t = argmax(out.row(s)));
    }
    let dt = t0.elapsed().as_secs_f64();
    (0..b).for_each(|s| be.drop_session(s as u64));
    dt
}

/// Seconds for one sequence of `tokens` greedy tokens through `decode` (the single path).
fn time_decode(be: &mut CpuBackend, tokens: usize) -> f64 {
    let vocab = be.config().vocab_size;
    let p = prompt(0, vocab);
    let first = argmax(&be.prefill(0, &p, Logits::Last).unwrap());
    let req = DecodeRequest {
        session: 0,
        first_token: first,
        max_tokens: tokens,
        sampling: &SamplingParams::greedy(),
        history: &p,
        want_logits: false,
    };
    let t0 = Instant::now();
    be.decode(&req, &mut |_| Flow::Continue).unwrap();
    let dt = t0.elapsed().as_secs_f64();
    be.drop_session(0);
    dt
}

/// The process's CPU seconds so far (user + system, every thread), from /proc (0 elsewhere).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command's closing parenthesis; utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|v| v.parse().ok())
        .collect();
    f.iter().sum::<f64>() / 100.0 // USER_HZ, 100 on Linux
}

/// Median, min and max of a sample.
struct Spread {
    med: f64,
    min: f64,
    max: f64,
}

impl Spread {
    fn of(mut v: Vec<f64>) -> Spread {
        v.sort_by(f64::total_cmp);
        Spread {
            med: v[v.len() / 2],
            min: v[0],
            max: v[v.len() - 1],
        }
    }

    /// As a rate `work / seconds`: median (slowest..fastest).
    fn rate(&self, work: f64) -> String {
        format!(
            "{:8.1} ({:.1}..{:.1})",
            work / self.med,
            work / self.max,
            work / self.min
        )
    }
}

/// Wall and CPU seconds of `reps` runs of `f` (which returns its wall seconds), after one
/// untimed warm-up.
fn measure(reps: usize, mut f: impl FnMut() -> f64) -> (Spread, Spread) {
    f();
    let (mut wall, mut cpu) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let c0 = cpu_seconds();
        wall.push(f());
        cpu.push((cpu_seconds() - c0).max(0.01));
    }
    (Spread::of(wall), Spread::of(cpu))
}

fn main() -> Result<(), String> {
    let o = parse()?;
    let mut cfg = Config::geometry(&o.geometry).map_err(|e| e.to_string())?;
    cfg.n_layer = o.layers.unwrap_or(cfg.n_layer);
    cfg.vocab_size = o.vocab.unwrap_or(cfg.vocab_size);
    let quant = SynthQuant::parse(&o.quant).map_err(|e| e.to_string())?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let path = dir.path().join("bench.gguf");
    synth::write(&path, &cfg, quant, 5, false).map_err(|e| e.to_string())?;
    let model = Arc::new(Model::load(&path).map_err(|e| e.to_string())?);
    let capacity = 16 + o.tokens + 1;
    let mut be = CpuBackend::new(model, capacity);
    println!(
        "{} ({} layers, vocab {}, {}), {} tokens a sequence, {}, median of {} (min..max)",
        o.geometry,
        cfg.n_layer,
        cfg.vocab_size,
        o.quant,
        o.tokens,
        be.info().device,
        o.reps
    );
    println!("aggregate tok/s by wall time | by CPU time; time of the B sequences / one decode");
    let n = o.tokens as f64;
    let (wall1, cpu1) = measure(o.reps, || time_decode(&mut be, o.tokens));
    println!("decode  B=1  {} | {}", wall1.rate(n), cpu1.rate(n));
    for &b in &o.batch {
        let (wall, cpu) = measure(o.reps, || time_batched(&mut be, b, o.tokens));
        let agg = b as f64 * n;
        println!(
            "batched B={b:<2} {} | {}   {:.2}x | {:.2}x",
            wall.rate(agg),
            cpu.rate(agg),
            wall.med / wall1.med,
            cpu.med / cpu1.med
        );
    }
    Ok(())
}

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use q4moe_model::synth::{self, SynthQuant};
use q4moe_model::Config;

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// tiny (tests), mid, or qwen3-30b-a3b (full size, ~17 GB at q4_0)
    #[arg(long, default_value = "tiny")]
    geometry: String,
    /// q4_0, q4_k, q4_k_m (llama.cpp's mix) or q8_0
    #[arg(long, default_value = "q4_0")]
    quant: String,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    dims: DimOverrides,
}

/// Any dimension of the named geometry can be overridden.
#[derive(Args, Debug, Default)]
pub struct DimOverrides {
    #[arg(long)]
    layers: Option<usize>,
    #[arg(long)]
    d_model: Option<usize>,
    #[arg(long)]
    heads: Option<usize>,
    #[arg(long)]
    kv_heads: Option<usize>,
    #[arg(long)]
    head_dim: Option<usize>,
    #[arg(long)]
    experts: Option<usize>,
    #[arg(long)]
    experts_used: Option<usize>,
    #[arg(long)]
    expert_ff: Option<usize>,
    #[arg(long)]
    vocab: Option<usize>,
    #[arg(long)]
    context: Option<usize>,
}

impl DimOverrides {
    pub fn apply(&self, c: &mut Config) {
        let set = |dst: &mut usize, v: Option<usize>| {
            if let Some(v) = v {
                *dst = v;
            }
        };
        set(&mut c.n_layer, self.layers);
        set(&mut c.d_model, self.d_model);
        set(&mut c.n_head, self.heads);
        set(&mut c.n_kv_head, self.kv_heads);
        set(&mut c.head_dim, self.head_dim);
        set(&mut c.n_expert, self.experts);
        set(&mut c.n_expert_used, self.experts_used);
        set(&mut c.d_ff_expert, self.expert_ff);
        set(&mut c.vocab_size, self.vocab);
        set(&mut c.context_length, self.context);
    }
}

/// The GGUF key each override sets, so a geometry error can name the flag to change.
const FLAGS: [(&str, &str); 10] = [
    ("block_count", "--layers"),
    ("embedding_length", "--d-model"),
    ("head_count_kv", "--kv-heads"),
    ("head_count", "--heads"),
    ("key_length", "--head-dim"),
    ("head dimension", "--head-dim"),
    ("expert_used_count", "--experts-used"),
    ("expert_count", "--experts"),
    ("expert_feed_forward_length", "--expert-ff"),
    ("vocab_size", "--vocab"),
];

/// `msg` with the flags behind the keys it names ("context_length" needs no table: --context).
fn with_flags(msg: String) -> String {
    let mut flags: Vec<&str> = Vec::new();
    let mut rest = msg.clone();
    for (key, flag) in FLAGS {
        // Longer keys come first in FLAGS, so "head_count_kv" is not also read as "head_count".
        if rest.contains(key) && !flags.contains(&flag) {
            flags.push(flag);
            rest = rest.replace(key, "");
        }
    }
    if msg.contains("context_length") {
        flags.push("--context");
    }
    match flags.is_empty() {
        true => msg,
        false => format!("{msg} (set by {})", flags.join(", ")),
    }
}

pub fn run(a: SynthArgs) -> anyhow::Result<()> {
    let mut cfg = Config::geometry(&a.geometry)?;
    a.dims.apply(&mut cfg);
    let quant = SynthQuant::parse(&a.quant)?;
    let t = Instant::now();
    let report = synth::write(&a.out, &cfg, quant, a.seed, true)
        .map_err(|e| anyhow::anyhow!(with_flags(e.to_string())))?;
    eprintln!(
        "wrote {} ({} tensors, {:.2} GB) in {:.1} s",
        a.out.display(),
        report.tensors,
        report.bytes as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

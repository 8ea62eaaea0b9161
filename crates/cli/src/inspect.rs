use std::path::PathBuf;

use clap::Args;
use q4moe_gguf::{GgufFile, Value};

#[derive(Args, Debug)]
pub struct InspectArgs {
    file: PathBuf,
    /// Print every element of long arrays.
    #[arg(long)]
    full: bool,
}

fn show(v: &Value, full: bool) -> String {
    match v {
        Value::String(s) if !full && s.len() > 120 => format!(
            "{:?}... ({} bytes)",
            &s[..s.floor_char_boundary(100)],
            s.len()
        ),
        Value::String(s) => format!("{s:?}"),
        Value::Array(ty, items) => {
            let shown = if full {
                items.len()
            } else {
                items.len().min(6)
            };
            let head: Vec<String> = items[..shown].iter().map(|x| show(x, full)).collect();
            let more = if shown < items.len() { ", ..." } else { "" };
            format!("[{ty:?}; {}] [{}{more}]", items.len(), head.join(", "))
        }
        other => format!("{other:?}"),
    }
}

pub fn run(a: InspectArgs) -> anyhow::Result<()> {
    let f = GgufFile::open(&a.file)?;
    let h = &f.header;
    println!(
        "{}: GGUF v{}, {} metadata keys, {} tensors, alignment {}",
        a.file.display(),
        h.version,
        h.metadata.len(),
        h.tensors.len(),
        h.alignment
    );
    println!("\nmetadata:");
    for (k, v) in &h.metadata {
        println!("  {k} = {}", show(v, a.full));
    }
    println!("\ntensors:");
    println!(
        "  {:<36} {:<6} {:<24} {:>14}",
        "name", "type", "shape", "bytes"
    );
    let mut total = 0u64;
    for t in &h.tensors {
        let bytes = t.n_bytes()?;
        total += bytes;
        println!(
            "  {:<36} {:<6} {:<24} {:>14}",
            t.name,
            t.ggml_type.name(),
            format!("{:?}", t.dims),
            bytes
        );
    }
    println!(
        "\n  total tensor bytes: {total} ({:.2} GB)",
        total as f64 / 1e9
    );
    Ok(())
}

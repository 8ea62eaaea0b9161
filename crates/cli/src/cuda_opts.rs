//! `--cuda-opt key=value`: the CUDA backend's typed options (q4moe_cuda::CudaOptions::KEYS),
//! parsed once here at the edge and passed down.

use anyhow::{bail, Result};
use q4moe_cuda::CudaOptions;

/// The help text of `--cuda-opt` (clap's `long_help`): every key with its values and default.
pub fn long_help() -> String {
    let mut s = String::from(
        "A CUDA backend option as KEY=VALUE (repeatable); `--cuda-opt help` lists them.\nKeys:\n",
    );
    for (key, doc) in CudaOptions::KEYS {
        s.push_str(&format!("  {key:<20} {doc}\n"));
    }
    s
}

/// Applies each `KEY=VALUE` of `opts` to `base`, in order (a later one wins). `help` prints the
/// keys and exits.
pub fn apply(base: CudaOptions, opts: &[String]) -> Result<CudaOptions> {
    let mut out = base;
    for o in opts {
        if o == "help" {
            print!("{}", long_help());
            std::process::exit(0);
        }
        let Some((key, value)) = o.split_once('=') else {
            bail!("--cuda-opt '{o}': expected KEY=VALUE (`--cuda-opt help` lists the keys)");
        };
        out.set(key.trim(), value.trim())
            .map_err(|e| anyhow::anyhow!("--cuda-opt {o}: {e}"))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn applies_in_order_and_names_a_bad_option() {
        let o = apply(
            CudaOptions::default(),
            &[
                "graph_steps=1".into(),
                "router_fold=off".into(),
                "graph_steps=3".into(),
            ],
        )
        .unwrap();
        assert_eq!(o.graph_steps, 3);
        assert!(!o.router_fold);
        let e = apply(CudaOptions::default(), &["graph_steps".into()]).unwrap_err();
        assert!(e.to_string().contains("expected KEY=VALUE"), "{e}");
        let e = apply(CudaOptions::default(), &["no_such=1".into()]).unwrap_err();
        assert!(e.to_string().contains("no_such"), "{e}");
    }
}

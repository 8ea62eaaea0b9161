//! How the weights use the L2 cache, set by access-policy windows on the launches that read
//! them. A token streams ~1.9 GB of weights through a 50 MB L2, each line read once, while the
//! step's own data (the residual, partials, router slots, the new K/V rows, the flags blocks
//! poll) is read again a few µs later. By default (CudaOptions::l2_stream) the weight launches
//! mark their weights streaming, evicted first, so the step's own lines stay (session 35:
//! +0.2-0.3%). The other way round, part of the L2 can be set aside (cuCtxSetLimit) for
//! persisting lines of chosen weights (CudaOptions::l2_targets: the output head, read at DRAM
//! bandwidth, or the router folds), the hit ratio spreading the set-aside over them, so later
//! tokens read those from L2; off by default: on the H200 the layers lost more to the smaller
//! normal L2 than the held weights saved (-2% to -4%, NOTES.md session 35).

use q4moe_model::Config;

use crate::device::Device;
use crate::params::Qw;
use crate::weights::{LayerW, Weights};
use crate::{CudaOptions, Result};

/// Weights the set-aside L2 may hold (CudaOptions::l2_targets).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum L2Target {
    /// The output head's matrix (both planes where split).
    Head,
    /// Each layer's router fold ([n_expert, q_dim] F32, moe.cu RouterFold), which
    /// o_proj_router's router blocks read on the way to the experts' choice.
    Fold,
}

impl L2Target {
    /// Parses a comma-separated list ("head,fold"); "none" or "" is the empty list.
    pub fn parse_list(s: &str) -> std::result::Result<Vec<L2Target>, String> {
        s.split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty() && *t != "none")
            .map(|t| match t {
                "head" => Ok(L2Target::Head),
                "fold" => Ok(L2Target::Fold),
                other => Err(format!("unknown L2 target '{other}' (head, fold)")),
            })
            .collect()
    }
}

/// A launch's access-policy window: with `persist`, `hit_ratio` of the lines in
/// [base, base + bytes) persist in L2 and the rest stream (evicted first); without, all stream.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct L2Window {
    pub base: u64,
    pub bytes: usize,
    pub hit_ratio: f32,
    pub persist: bool,
}

/// Which launches get a window, and with what hit ratio; the default holds nothing.
#[derive(Clone, Debug, Default)]
pub struct L2Plan {
    targets: Vec<L2Target>,
    hit_ratio: f32,
    max_window: usize,
    stream: bool,
    /// L2 bytes set aside for persisting lines (0: none).
    persisting_bytes: usize,
}

impl L2Plan {
    /// Sets aside L2 for `opts.l2_targets` (as much as the device allows, or
    /// opts.l2_persist_mib) and spreads it over their regions by one hit ratio.
    pub fn new(dev: &Device, c: &Config, w: &Weights, opts: &CudaOptions) -> Result<L2Plan> {
        let (max_persist, max_window) = dev.l2_persist_limits()?;
        let want = opts
            .l2_persist_mib
            .map_or(usize::MAX, |m| m.saturating_mul(1 << 20));
        let regions: usize = regions(c, w, &opts.l2_targets)
            .map(|(_, bytes)| bytes.min(max_window))
            .sum();
        let stream = opts.l2_stream && max_window > 0;
        if want.min(max_persist) == 0 || regions == 0 {
            return Ok(L2Plan {
                max_window,
                stream,
                ..L2Plan::default()
            });
        }
        let persisting_bytes = dev.set_persisting_l2(want.min(max_persist))?;
        let hit_ratio = hit_ratio(persisting_bytes, regions);
        tracing::info!(
            "L2: {persisting_bytes} bytes persisting (device max {max_persist}, window max \
             {max_window}) over {regions} bytes of {:?}: hit ratio {hit_ratio:.3}",
            opts.l2_targets
        );
        Ok(L2Plan {
            targets: opts.l2_targets.clone(),
            hit_ratio,
            max_window,
            stream,
            persisting_bytes,
        })
    }

    /// The policy in words, for benchmark records.
    pub fn describe(&self) -> String {
        let stream = match self.stream {
            true => "weight launches streaming in L2 (evict-first windows)",
            false => "weight launches normal in L2",
        };
        match self.persisting_bytes {
            0 => format!("{stream}; no L2 set aside"),
            n => format!("{stream}; {n} bytes of L2 persisting {:?}", self.targets),
        }
    }

    /// The output head's window: persisting where the plan holds it, else streaming.
    pub fn head(&self, c: &Config, w: &Weights) -> Option<L2Window> {
        self.persisting(L2Target::Head, head_region(c, w))
            .or_else(|| self.stream(&[(w.output, c.vocab_size)]))
    }

    /// o_proj_router's window: the layer's router fold persisting where the plan holds it,
    /// else o and the router rows streaming.
    pub fn o_proj(&self, c: &Config, lw: &LayerW) -> Option<L2Window> {
        fold_region(c, lw)
            .and_then(|r| self.persisting(L2Target::Fold, r))
            .or_else(|| self.stream(&[(lw.o, c.d_model), (lw.router, c.n_expert)]))
    }

    /// A streaming window over matrices (Qw, rows) that lie together (the weights' plan keeps
    /// a layer's in order), where the plan streams.
    pub fn stream(&self, mats: &[(Qw, usize)]) -> Option<L2Window> {
        let start = mats.iter().map(|(w, _)| w.data).min()?;
        let end = mats
            .iter()
            .map(|(w, rows)| w.data + crate::step::weight_bytes(w, *rows))
            .max()?;
        self.stream
            .then(|| self.window((start, (end - start) as usize), 1.0, false))?
    }

    fn persisting(&self, t: L2Target, region: (u64, usize)) -> Option<L2Window> {
        (self.hit_ratio > 0.0 && self.targets.contains(&t))
            .then(|| self.window(region, self.hit_ratio, true))?
    }

    /// A window over `region` as far as the device's largest reaches; none over nothing.
    fn window(
        &self,
        (base, bytes): (u64, usize),
        hit_ratio: f32,
        persist: bool,
    ) -> Option<L2Window> {
        let bytes = bytes.min(self.max_window);
        (base != 0 && bytes > 0).then_some(L2Window {
            base,
            bytes,
            hit_ratio,
            persist,
        })
    }
}

/// The share of each window's lines that persist so that all of them together fill
/// `persisting` bytes (at most every line).
fn hit_ratio(persisting: usize, regions: usize) -> f32 {
    (persisting as f64 / regions.max(1) as f64).min(1.0) as f32
}

/// (base, bytes) of every region `targets` name.
fn regions<'a>(
    c: &'a Config,
    w: &'a Weights,
    targets: &'a [L2Target],
) -> impl Iterator<Item = (u64, usize)> + 'a {
    let head = targets.contains(&L2Target::Head).then(|| head_region(c, w));
    let folds = w
        .layers
        .iter()
        .filter(|_| targets.contains(&L2Target::Fold))
        .filter_map(|lw| fold_region(c, lw));
    head.into_iter().chain(folds)
}

fn head_region(c: &Config, w: &Weights) -> (u64, usize) {
    (
        w.output.data,
        crate::step::weight_bytes(&w.output, c.vocab_size) as usize,
    )
}

fn fold_region(c: &Config, lw: &LayerW) -> Option<(u64, usize)> {
    (lw.router_fold != 0).then_some((lw.router_fold, c.n_expert * c.q_dim() * 4))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hit_ratio_fills_the_set_aside_and_never_passes_one() {
        assert_eq!(hit_ratio(30 << 20, 120 << 20), 0.25);
        assert_eq!(hit_ratio(30 << 20, 10 << 20), 1.0);
        assert_eq!(hit_ratio(0, 10 << 20), 0.0);
        assert_eq!(hit_ratio(1, 0), 1.0);
    }

    fn q4_0(data: u64, k: i32) -> Qw {
        Qw {
            data,
            scales: 0,
            ty: q4moe_gguf::GgmlType::Q4_0.id() as i32,
            k,
        }
    }

    #[test]
    fn a_stream_window_spans_its_matrices_up_to_the_largest_window() {
        let plan = L2Plan {
            stream: true,
            max_window: 1 << 20,
            ..L2Plan::default()
        };
        // 64 weights a row: 2 blocks of 18 device bytes (nibbles and scale).
        let (a, b) = (q4_0(4096, 64), q4_0(4096 + 10 * 36, 64));
        let w = plan.stream(&[(b, 4), (a, 10)]).unwrap();
        assert_eq!((w.base, w.bytes, w.persist), (4096, 14 * 36, false));
        assert_eq!(w.hit_ratio, 1.0);
        let big = plan.stream(&[(a, 1 << 20)]).unwrap();
        assert_eq!(big.bytes, 1 << 20);
        assert!(plan.stream(&[]).is_none());
        assert!(plan.stream(&[(a, 0)]).is_none());
        let off = L2Plan {
            stream: false,
            ..plan
        };
        assert!(off.stream(&[(a, 10)]).is_none());
    }

    #[test]
    fn targets_parse_and_unknown_ones_are_named() {
        assert_eq!(
            L2Target::parse_list("head, fold").unwrap(),
            [L2Target::Head, L2Target::Fold]
        );
        assert!(L2Target::parse_list("none").unwrap().is_empty());
        assert!(L2Target::parse_list("").unwrap().is_empty());
        let err = L2Target::parse_list("head,experts").unwrap_err();
        assert!(err.contains("'experts'"), "{err}");
    }
}

//! How the weights use the L2 cache, set by access-policy windows on the launches that read
//! them. A token streams ~1.9 GB of weights through a 50 MB L2, each line read once, while the
//! step's own data (the residual, partials, router slots, the new K/V rows, the flags blocks
//! poll) is read again a few µs later. The weight launches (qkv, o_proj, the experts', the head)
//! mark their weights streaming, evicted first, so the step's own lines stay (session 35, one
//! binary, 3 calls: +0.2% Q4_K_M, +0.3% Q4_0).

use q4moe_model::Config;

use crate::launch::L2Window;
use crate::params::Qw;
use crate::weights::{weight_bytes, LayerW, Weights};

/// Which launches get a window: none where the device has no L2 controls.
#[derive(Clone, Copy, Debug, Default)]
pub struct L2Plan {
    /// The largest window the device takes (0: no windows).
    max_window: usize,
}

impl L2Plan {
    pub fn new(max_window: usize) -> L2Plan {
        L2Plan { max_window }
    }

    /// The policy in words, for benchmark records.
    pub fn describe(&self) -> String {
        match self.max_window {
            0 => "weight launches normal in L2 (no access-policy windows on this device)",
            _ => "weight launches streaming in L2 (evict-first windows)",
        }
        .into()
    }

    /// The output head's window.
    pub fn head(&self, c: &Config, w: &Weights) -> Option<L2Window> {
        self.stream(&[(w.output, c.vocab_size)])
    }

    /// o_proj_router's window: o and the router rows.
    pub fn o_proj(&self, c: &Config, lw: &LayerW) -> Option<L2Window> {
        self.stream(&[(lw.o, c.d_model), (lw.router, c.n_expert)])
    }

    /// A streaming window over matrices (Qw, rows) that lie together (the weights' plan keeps
    /// a layer's in order), as far as the device's largest reaches; none over nothing.
    pub fn stream(&self, mats: &[(Qw, usize)]) -> Option<L2Window> {
        let start = mats.iter().map(|(w, _)| w.data).min()?;
        let end = mats
            .iter()
            .map(|(w, rows)| w.data + weight_bytes(w, *rows))
            .max()?;
        let bytes = ((end - start) as usize).min(self.max_window);
        (start != 0 && bytes > 0).then_some(L2Window { base: start, bytes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let plan = L2Plan::new(1 << 20);
        // 64 weights a row: 2 blocks of 18 device bytes (nibbles and scale).
        let (a, b) = (q4_0(4096, 64), q4_0(4096 + 10 * 36, 64));
        let w = plan.stream(&[(b, 4), (a, 10)]).unwrap();
        assert_eq!((w.base, w.bytes), (4096, 14 * 36));
        let big = plan.stream(&[(a, 1 << 20)]).unwrap();
        assert_eq!(big.bytes, 1 << 20);
        assert!(plan.stream(&[]).is_none());
        assert!(plan.stream(&[(a, 0)]).is_none());
        assert!(
            L2Plan::new(0).stream(&[(a, 10)]).is_none(),
            "no L2 controls"
        );
    }
}

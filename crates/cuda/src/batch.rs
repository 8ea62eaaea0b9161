//! The batched decode step (`Backend::step_batch`): one token of each of B sessions through
//! every layer together, on the batched prefill's kernels (prefill.rs), so each weight row is
//! read once a step for all B rows and each chosen expert once for the tokens that chose it
//! (pf_route picks every token's experts on the device, pf_lists groups the tokens by expert,
//! pf_mma runs an expert's tokens in tiles on the int8 tensor cores); each token attends over
//! its own session's cache at its own position (bt_attn_gqa_tc on tensor cores for Qwen3-MoE's
//! shape, else bt_qk_norm_rope and bt_attn_split: a table on the device of each row's cache,
//! rewritten each step); then the output head for all B and each
//! row's arg-max on the device (bt_argmax). A row whose sampler is plain greedy and that asks
//! for no logits takes that token (B tokens come back, not B x vocab logits); the others' logits
//! come back to the host, where their samplers choose (`choose_row`, as the CPU does).
//!
//! Batch invariance: every kernel computes a token's row from that token's inputs alone, and
//! its reductions run in one order whatever the rows beside it: the integer block sums are
//! exact, the blocks' scaled sums add in k order within a row, the attention's chunks merge in
//! index order up to the row's own length (pf_attn_combine), the experts' outputs add in the
//! token's slot order (pf_combine_quant). So a sequence's logits are bit-identical alone (B = 1) or
//! in any batch, in any slot (tests/batch.rs checks it on the device). They are not those of
//! the single-stream decode step (`decode`), whose kernels differ (dp4a matvecs, fused tails):
//! a sequence stays on one path from its first generated token to its last.

use q4moe_model::backend::RowCopies;
use q4moe_model::Config;

use crate::device::Device;
use crate::graph::Graph;
use crate::kernel::Kernel;
use crate::launch::Launch;
use crate::memory::DevBuf;
use crate::params::{BtArgmaxParams, StepState};
use crate::prefill::Prefill;
use crate::step::Kv;
use crate::weights::Weights;
use crate::Result;

/// One row of a submission: its token, its session's cache, and the position it goes to.
pub(crate) struct Row<'a> {
    pub token: u32,
    pub kv: &'a Kv,
    pub pos: usize,
}

/// What a captured batched step is valid for: the rows' count and attention chunks, and the
/// buffers its launches address (reallocated buffers are new addresses, so a stale graph is
/// never replayed). The rows' tokens, positions and caches are read from the device each step,
/// so the sessions are not part of the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BatchKey {
    pub rows: usize,
    /// Attention chunks of the longest row's context (prefill.rs n_split): the grid and the
    /// partials' layout.
    pub chunks: usize,
    buffers: [u64; 4],
}

/// The positions a step's launches are built for: every position of its attention chunks.
fn reach(chunks: usize) -> usize {
    chunks * crate::params::ATT_CHUNK
}

/// The attention chunks a captured step is built for: the longest row's, rounded up to 1, 2, 4
/// or a multiple of 8 (256 positions), so one graph serves up to 256 steps of the rows'
/// growth instead of 32 (a capture every 32 steps of a running batch). A chunk past a row's
/// context writes an empty partial that the merge skips (attn_split_chunk, attn_combine_unit:
/// the merge walks the row's own chunks), so the bucket changes no row's bits; the extra blocks
/// exit at once.
fn chunk_bucket(chunks: usize) -> usize {
    if chunks <= 4 {
        chunks.max(1).next_power_of_two()
    } else {
        chunks.div_ceil(8) * 8
    }
}

/// Captured graphs kept at most (one a batch size in steady use).
const GRAPHS: usize = 32;

/// The batched step's own buffers, grown to the largest batch seen, and its captured graphs.
#[derive(Default)]
pub(crate) struct BatchBufs {
    /// [n_layer][rows][2] cache addresses (K, V), rewritten each step.
    tab: Option<DevBuf>,
    /// [rows][vocab] logits.
    logits: Option<DevBuf>,
    /// [rows] each row's arg-max (bt_argmax), and its host copy.
    tokens: Option<DevBuf>,
    pub chosen: Vec<u32>,
    states: Vec<StepState>,
    addrs: Vec<u64>,
    graphs: Vec<(BatchKey, Graph)>,
    /// The host samplers' copies of their rows' logits.
    pub copies: RowCopies,
}

/// `buf` holding at least `bytes`, reallocated where it is smaller.
fn at_least(dev: &Device, buf: &mut Option<DevBuf>, bytes: usize) -> Result<u64> {
    if buf.as_ref().is_none_or(|b| b.bytes < bytes) {
        *buf = None; // the old one freed first
        *buf = Some(DevBuf::new(dev, bytes)?);
    }
    Ok(buf.as_ref().expect("allocated").ptr)
}

impl BatchBufs {
    /// Uploads the rows' step states and cache table; returns the key of the step's launches.
    pub fn load(
        &mut self,
        dev: &Device,
        c: &Config,
        p: &mut Prefill,
        rows: &[Row<'_>],
    ) -> Result<BatchKey> {
        let n = rows.len();
        self.states.clear();
        self.states.extend(rows.iter().map(|r| StepState {
            token: r.token,
            pos: r.pos as u32,
        }));
        self.addrs.clear();
        for l in 0..c.n_layer {
            for r in rows {
                let (k, v) = r.kv.layer(c, l);
                self.addrs.extend([k, v]);
            }
        }
        let longest = rows.iter().map(|r| r.pos + 1).max().unwrap_or(1);
        let chunks = chunk_bucket(crate::prefill::n_split(longest));
        let tab = at_least(dev, &mut self.tab, 8 * self.addrs.len())?;
        let logits = at_least(dev, &mut self.logits, 4 * n * c.vocab_size)?;
        let tokens = at_least(dev, &mut self.tokens, 4 * n)?;
        let t = self.tab.as_ref().expect("allocated");
        t.upload(dev, 0, &self.addrs)?;
        let part = p.load_rows(dev, c, &self.states, reach(chunks))?;
        Ok(BatchKey {
            rows: n,
            chunks,
            buffers: [tab, logits, part, tokens],
        })
    }

    /// The launches of the step `key` describes: the rows through every layer, the head, and
    /// each row's arg-max.
    pub fn launches(&self, c: &Config, w: &Weights, p: &Prefill, key: &BatchKey) -> Vec<Launch> {
        let [tab, logits, _, tokens] = key.buffers;
        let mut out = p.step_launches(c, w, (tab, reach(key.chunks)), key.rows, logits);
        let a = BtArgmaxParams {
            logits,
            tokens,
            n: c.vocab_size as i32,
            pad: 0,
        };
        let grid = (key.rows as u32, 1, 1);
        out.push(Launch::new(
            Kernel::BtArgmax,
            "bt_argmax",
            grid,
            1024,
            0,
            &a,
            0,
        ));
        out
    }

    /// The graph captured for `key`, if any.
    pub fn graph_for(&self, key: &BatchKey) -> Option<usize> {
        self.graphs.iter().position(|(k, _)| k == key)
    }

    /// Replays the graph captured for `key`, capturing it first from `launches` on a miss (the
    /// caller builds them where `graph_for` found none); true where it captured.
    pub fn replay(
        &mut self,
        dev: &Device,
        key: BatchKey,
        launches: Option<Vec<Launch>>,
    ) -> Result<bool> {
        let (i, captured) = match (self.graph_for(&key), launches) {
            (Some(i), _) => (i, false),
            (None, Some(ls)) => {
                let graph = Graph::capture(dev, &ls)?;
                // One graph a batch size: a longer context's replaces the shorter one's.
                self.graphs.retain(|(k, _)| k.rows != key.rows);
                if self.graphs.len() >= GRAPHS {
                    self.graphs.remove(0);
                }
                self.graphs.push((key, graph));
                (self.graphs.len() - 1, true)
            }
            (None, None) => unreachable!("launches are built where no graph is cached"),
        };
        self.graphs[i].1.launch(dev)?;
        Ok(captured)
    }

    /// After the last submission (waits for it): its `n` rows' arg-maxes into `self.chosen`,
    /// and the logits of the rows `want` names into `out` ([n][vocab], the other rows left as
    /// they were).
    pub fn read(
        &mut self,
        dev: &Device,
        vocab: usize,
        want: &[bool],
        out: &mut [f32],
    ) -> Result<()> {
        let n = want.len();
        self.chosen.resize(n, 0);
        let tokens = self.tokens.as_ref().expect("loaded");
        tokens.download(dev, 0, &mut self.chosen)?;
        let buf = self.logits.as_ref().expect("loaded");
        // Runs of wanted rows, one copy a run.
        let mut i = 0;
        while i < n {
            if !want[i] {
                i += 1;
                continue;
            }
            let end = (i..n).find(|&j| !want[j]).unwrap_or(n);
            buf.download(dev, 4 * i * vocab, &mut out[i * vocab..end * vocab])?;
            i = end;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{chunk_bucket, reach};
    use crate::prefill::n_split;

    /// Every context reaches no further than its bucket, the bucket at most 7 chunks (224
    /// positions) past it, and a bucket holds for 256 positions of growth past 128.
    #[test]
    fn a_bucket_covers_the_longest_row_and_changes_every_256_positions() {
        for len in 1..=40_000 {
            let (chunks, b) = (n_split(len), chunk_bucket(n_split(len)));
            assert!(
                reach(b) >= len && b >= chunks && b - chunks < 8,
                "{len}: {chunks} -> {b}"
            );
        }
        let buckets: Vec<usize> = [1, 33, 65, 97, 129, 384, 385, 640, 641]
            .map(|len| chunk_bucket(n_split(len)))
            .to_vec();
        assert_eq!(buckets, [1, 2, 4, 4, 8, 16, 16, 24, 24]);
        // Past 128 positions a bucket holds for 256 of them: it changes at 257, 513, ...
        let changes: Vec<usize> = (130..=4096)
            .filter(|&len| chunk_bucket(n_split(len)) != chunk_bucket(n_split(len - 1)))
            .collect();
        assert_eq!(changes, (1..16).map(|i| 256 * i + 1).collect::<Vec<_>>());
    }
}

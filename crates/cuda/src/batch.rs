//! The batched decode step (`Backend::step_batch`): one token of each of B sessions through
//! every layer together, on the batched prefill's kernels (prefill.rs), so each weight row is
//! read once a step for all B rows and each chosen expert once for the tokens that chose it
//! (pf_route picks every token's experts on the device, pf_lists groups the tokens by expert,
//! pf_mma runs an expert's tokens in tiles on the int8 tensor cores); each token attends over
//! its own session's cache at its own position (bt_qk_norm_rope, bt_attn_split: a table on the
//! device of each row's cache, rewritten each step); then the output head for all B, whose
//! logits come back to the host, where each row's sampler chooses (`choose_tokens`, as the CPU
//! does).
//!
//! Batch invariance: every kernel computes a token's row from that token's inputs alone, and
//! its reductions run in one order whatever the rows beside it: the integer block sums are
//! exact, the blocks' scaled sums add in k order within a row, the attention's chunks merge in
//! index order up to the row's own length (pf_attn_combine), the experts' outputs add in the
//! token's slot order (pf_combine). So a sequence's logits are bit-identical alone (B = 1) or
//! in any batch, in any slot (tests/batch.rs checks it on the device). They are not those of
//! the single-stream decode step (`decode`), whose kernels differ (dp4a matvecs, fused tails):
//! a sequence stays on one path from its first generated token to its last.

use q4moe_model::Config;

use crate::device::Device;
use crate::launch::Launch;
use crate::memory::DevBuf;
use crate::params::StepState;
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

/// The batched step's own buffers, grown to the largest batch seen.
#[derive(Default)]
pub(crate) struct BatchBufs {
    /// [n_layer][rows][2] cache addresses (K, V), rewritten each step.
    tab: Option<DevBuf>,
    /// [rows][vocab] logits.
    logits: Option<DevBuf>,
    states: Vec<StepState>,
    addrs: Vec<u64>,
    /// The host sampler's copy of a row's logits.
    pub tmp: Vec<f32>,
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
    /// Uploads the rows' step states and cache table and returns one submission's launches:
    /// the rows through every layer and the head.
    pub fn prepare(
        &mut self,
        dev: &Device,
        c: &Config,
        w: &Weights,
        p: &mut Prefill,
        rows: &[Row<'_>],
    ) -> Result<Vec<Launch>> {
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
        let len = rows.iter().map(|r| r.pos + 1).max().unwrap_or(1);
        let tab = at_least(dev, &mut self.tab, 8 * self.addrs.len())?;
        let logits = at_least(dev, &mut self.logits, 4 * n * c.vocab_size)?;
        let t = self.tab.as_ref().expect("allocated");
        t.upload(dev, 0, &self.addrs)?;
        p.load_rows(dev, c, &self.states, len)?;
        Ok(p.step_launches(c, w, (tab, len), n, logits))
    }

    /// Appends the last submission's `n` rows of logits to `out` (waits for the submission).
    pub fn logits_to(
        &self,
        dev: &Device,
        n: usize,
        vocab: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let at = out.len();
        out.resize(at + n * vocab, 0.0);
        let buf = self.logits.as_ref().expect("prepared");
        buf.download(dev, 0, &mut out[at..])
    }
}

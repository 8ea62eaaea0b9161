//! sample.cu's launches: what a step runs after its layers (the output head and the token's
//! choice: the greedy arg-max, in the head's own tail where it can, or the device sampler with
//! the penalties), and the device sampler's settings.

use q4moe_model::sampling::SamplingParams;
use q4moe_model::Config;

use super::matvec::{looped, matvec, matvec_params, Mv};
use super::modes::{smem_x, THREADS};
use super::scratch::{Scratch, ARGMAX_BLOCKS};
use crate::kernel::{Kernel, MatvecMode};
use crate::launch::Launch;
use crate::params::*;
use crate::weights::Weights;

/// The device sampler's settings for `p`, or None when it needs the host sampler (top-k above
/// SAMPLE_MAX_K). Top-k off is the device's nucleus (with a top-p cut) or its
/// vocabulary-order walk (without).
pub fn sample_config(p: &SamplingParams) -> Option<SampleConfig> {
    (p.top_k <= SAMPLE_MAX_K).then_some(SampleConfig {
        temperature: p.temperature,
        top_k: p.top_k as i32,
        top_p: p.top_p,
        min_p: p.min_p,
        repetition: p.repetition_penalty,
        presence: p.presence_penalty,
        frequency: p.frequency_penalty,
        pad: 0,
    })
}

/// How a step chooses its token after the head: the arg-max or the device sampler
/// (`sampled`), after the penalties of the request's history and draws (`penalized`) and
/// the constraint's mask (`masked`: the ids Scratch::mask, which the host writes before each
/// step, does not allow go to -inf), in the host sampler's order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Choice {
    pub sampled: bool,
    pub penalized: bool,
    pub masked: bool,
}

impl Choice {
    /// The choice of an unconstrained request (a constrained one sets `masked`).
    pub fn of(p: &SamplingParams) -> Choice {
        Choice {
            sampled: !p.is_greedy(),
            penalized: p.has_penalties(),
            masked: false,
        }
    }
}

/// What a step runs after its layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// The output head and the token's choice (decode; a prompt's last token).
    Head(Choice),
    /// Nothing: a prompt's tokens before its last leave only their keys and values (the head
    /// read 175 MB a token, ~3% of a Qwen3-30B-A3B step).
    LayersOnly,
}

/// The device sampler over `n` logits (sample.cu): each chunk's candidates, the walk's chunk
/// sums or the nucleus's bucket sums, the nucleus's edge, then the draw. `p`'s buffers as
/// sample_bytes(n) sizes them; n, n_blocks and walk_cpb are set here.
pub(crate) fn sample(mut p: SampleParams, n: usize) -> [Launch; 4] {
    p.n = n as i32;
    p.n_blocks = n.div_ceil(SAMPLE_CHUNK) as i32;
    // A walk block's chunks in at most 32 KB of shared memory where they fit.
    let len = n.div_ceil(WALK_CHUNKS).max(1);
    p.walk_cpb = (8192 / len).clamp(1, 32) as i32;
    let walk_smem = (p.walk_cpb as usize * len * 4) as u32;
    let walk_blocks = WALK_CHUNKS.div_ceil(p.walk_cpb as usize) as u32;
    let threads = SAMPLE_MAX_K as u32;
    [
        Launch::new(
            Kernel::SamplePartial,
            "sample",
            (p.n_blocks as u32, 1, 1),
            threads,
            0,
            &p,
            0,
        ),
        Launch::new(
            Kernel::SampleWalk,
            "sample",
            (walk_blocks, 1, 1),
            256,
            walk_smem,
            &p,
            0,
        ),
        Launch::new(
            Kernel::SampleEdge,
            "sample",
            (p.n_blocks as u32, 1, 1),
            threads,
            0,
            &p,
            0,
        ),
        Launch::new(Kernel::SampleTopk, "sample", (1, 1, 1), threads, 0, &p, 0),
    ]
}

/// The output head, then the token choice as `ending` says: the penalties (rewriting the
/// logits), the arg-max or the device sampler, the choice counted for the next penalties. A
/// plain greedy choice runs in the head's own tail where it can (`head_argmax`).
pub fn tail(c: &Config, w: &Weights, s: &Scratch, ending: Ending) -> Vec<Launch> {
    let Ending::Head(choice) = ending else {
        return Vec::new();
    };
    let rows = [(w.output, s.logits.ptr, c.vocab_size)];
    let head = Mv {
        norm: w.output_norm,
        eps: c.rms_eps,
        ..Mv::new(&rows, s.x.ptr, c.d_model)
    };
    let l2 = s.l2.head(c, w);
    let greedy = !choice.sampled && !choice.penalized && !choice.masked;
    let am = argmax_params(c, s, 0);
    if let Some(l) = greedy
        .then(|| head_argmax(&head, s.head_blocks, am, s.head_counter.ptr))
        .flatten()
    {
        return vec![l.with_l2(l2)];
    }
    let mut out = vec![looped(matvec("head", &head).with_l2(l2), s.head_blocks)];
    let p = SampleParams {
        logits: s.logits.ptr,
        state: s.state.ptr,
        publish: s.publish,
        cfg: s.sample_cfg.ptr,
        rng: s.rng.ptr,
        work: s.sample_work.ptr,
        finite: s.sample_finite.ptr,
        nucleus: s.sample_nucleus.ptr,
        counts: s.sample_counts.ptr,
        n: c.vocab_size as i32,
        ..Default::default()
    };
    let one = |k: Kernel, grid: u32| Launch::new(k, "sample", (grid, 1, 1), THREADS, 0, &p, 0);
    if choice.penalized {
        out.push(one(
            Kernel::SamplePenalize,
            (c.vocab_size as u32).div_ceil(THREADS),
        ));
    }
    if choice.masked {
        let m = MaskLogitsParams {
            logits: s.logits.ptr,
            mask: s.mask.ptr,
            n: c.vocab_size as i32,
            pad: 0,
        };
        let grid = ((c.vocab_size as u32).div_ceil(THREADS), 1, 1);
        out.push(Launch::new(
            Kernel::MaskLogits,
            "sample",
            grid,
            THREADS,
            0,
            &m,
            0,
        ));
    }
    if choice.sampled {
        out.extend(sample(p, c.vocab_size));
    } else {
        out.extend(argmax(c, s));
    }
    if choice.penalized {
        out.push(one(Kernel::SampleCount, 1));
    }
    out
}

/// The head (`head`, one matrix) walking its rows on at most `blocks` blocks with the greedy
/// choice in its tail (greedy.cu head_argmax): the logits as the head writes them and the
/// state as `am`'s arg-max (its partials at least the grid's; `counter` a zeroed u32). None
/// where the rows have no staged mode or `blocks` is 0 (a block a unit of rows: no walk).
pub(crate) fn head_argmax(
    head: &Mv,
    blocks: u32,
    am: ArgmaxParams,
    counter: u64,
) -> Option<Launch> {
    let (mv, mode, rows_blocks, bytes) = matvec_params(head);
    let MatvecMode::Staged { kernel, .. } = mode else {
        return None;
    };
    if blocks == 0 {
        return None;
    }
    let grid = rows_blocks.min(blocks);
    let p = HeadArgmaxParams {
        mv,
        am: ArgmaxParams {
            n_blocks: grid as i32,
            ..am
        },
        counter,
    };
    Some(Launch::new(
        Kernel::HeadArgmax(kernel),
        "head",
        (grid, 1, 1),
        THREADS,
        smem_x(head.k),
        &p,
        bytes,
    ))
}

/// The arg-max's params over the logits into the step state, `n_blocks` partials.
fn argmax_params(c: &Config, s: &Scratch, n_blocks: usize) -> ArgmaxParams {
    ArgmaxParams {
        logits: s.logits.ptr,
        part_v: s.am_v.ptr,
        part_i: s.am_i.ptr,
        state: s.state.ptr,
        publish: s.publish,
        n: c.vocab_size as i32,
        n_blocks: n_blocks as i32,
    }
}

/// The arg-max of the logits into the step state: partial maxima, then the final one.
fn argmax(c: &Config, s: &Scratch) -> [Launch; 2] {
    let am = argmax_params(c, s, ARGMAX_BLOCKS);
    [
        Launch::new(
            Kernel::ArgmaxPartial,
            "argmax",
            (ARGMAX_BLOCKS as u32, 1, 1),
            THREADS,
            0,
            &am,
            0,
        ),
        Launch::new(Kernel::ArgmaxFinal, "argmax", (1, 1, 1), 128, 0, &am, 0),
    ]
}

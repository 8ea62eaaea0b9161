//! matvec.cu's launches: up to three matrices over one input (qkv, o_proj, the router, the
//! output head), in the mode `modes::mv_mode` picks.

use super::modes::{mv_mode, rows_per_warp, smem_x, THREADS, WARPS};
use crate::kernel::{Kernel, MatvecMode};
use crate::launch::Launch;
use crate::params::{MatvecParams, Qw};
use crate::weights::weight_bytes;

/// One matvec launch's operands: up to three matrices (weights, output, rows) whose rows are
/// concatenated in the output space, over one input of k values.
pub(crate) struct Mv<'a> {
    pub ws: &'a [(Qw, u64, usize)],
    pub input: u64,
    pub k: usize,
    /// RMSNorm weight applied to the input (0: none), with `eps`
    pub norm: u64,
    pub eps: f32,
    /// Where block 0 also stores the normalised input (0: nowhere; the generic mode only)
    pub xn_out: u64,
    /// out += result (the residual add) instead of out = result
    pub accumulate: bool,
}

impl<'a> Mv<'a> {
    /// `ws` times `input`, no norm, no residual.
    pub fn new(ws: &'a [(Qw, u64, usize)], input: u64, k: usize) -> Mv<'a> {
        Mv {
            ws,
            input,
            k,
            norm: 0,
            eps: 0.0,
            xn_out: 0,
            accumulate: false,
        }
    }
}

pub(crate) fn matvec(name: &'static str, m: &Mv) -> Launch {
    let (p, mode, blocks, bytes) = matvec_params(m);
    let smem = smem_x(m.k);
    Launch::new(
        Kernel::Matvec(mode),
        name,
        (blocks, 1, 1),
        THREADS,
        smem,
        &p,
        bytes,
    )
}

/// `matvec`'s params, mode, blocks and weight bytes.
pub(crate) fn matvec_params(m: &Mv) -> (MatvecParams, MatvecMode, u32, u64) {
    let Mv {
        ws,
        input,
        k,
        norm,
        eps,
        xn_out,
        accumulate,
    } = *m;
    let mut p = MatvecParams {
        input,
        norm,
        xn_out,
        k: k as i32,
        accumulate: accumulate as i32,
        eps,
        n_w: ws.len() as i32,
        ..Default::default()
    };
    let mut total = 0;
    for (i, (w, out, rows)) in ws.iter().enumerate() {
        p.w[i] = *w;
        p.out[i] = *out;
        p.rows[i] = *rows as i32;
        total += rows;
    }
    // The staged modes keep only the quantised input (matvec.cu mv_staged): none for xn_out.
    let (mode, rpw) = if xn_out == 0 {
        mv_mode(ws, k)
    } else {
        (MatvecMode::Generic, rows_per_warp(total))
    };
    p.rows_per_warp = rpw as i32;
    let blocks = total.div_ceil(rpw * WARPS as usize) as u32;
    let bytes = ws.iter().map(|(w, _, r)| weight_bytes(w, *r)).sum();
    (p, mode, blocks, bytes)
}

/// `l` on at most `blocks` blocks that walk its rows grid-wide (matvec.cu mv_staged LOOP: the
/// staged modes' walking forms); other launches, and grids no larger, stay as they are. Only
/// for a `matvec` of one matrix without accumulate (the walk keeps the first unit's matrix and
/// reads no old outputs): the head, and the kernel test of it.
pub(crate) fn looped(mut l: Launch, blocks: u32) -> Launch {
    if let Kernel::Matvec(MatvecMode::Staged {
        kernel,
        walk: false,
    }) = l.kernel
    {
        if blocks > 0 && l.grid.0 > blocks {
            l.kernel = Kernel::Matvec(MatvecMode::Staged { kernel, walk: true });
            l.grid.0 = blocks;
        }
    }
    l
}

//! moe.cu's launches: the router (its own launch with the top-k, or folded into o_proj's),
//! then the chosen experts' gate/up and down.

use q4moe_model::Config;

use super::matvec::{matvec, matvec_params, Mv};
use super::modes::{
    down_mode, gate_up_mode, gate_up_smem, mv_mode, smem_x, EXPERTS_SMEM, THREADS, WARPS,
};
use super::scratch::Scratch;
use crate::kernel::{is_f32, DownMode, GateUpMode, Kernel, MatvecMode};
use crate::launch::Launch;
use crate::params::*;
use crate::weights::{weight_bytes, LayerW, Weights};

/// router_topk's block: its x load needs k <= 4 floats x 4 a thread (k <= 2048 here).
const ROUTER_THREADS: u32 = 128;
/// router_cluster's cluster (blocks) and rows a block (warps): RC_BLOCKS / RC_WARPS in moe.cu.
const RC_BLOCKS: usize = 8;
const RC_WARPS: usize = 16;

/// Whether every layer's router is folded into its o_proj launch (moe.cu RouterFold): the fold
/// was built (weights.rs router_fold_applies) and o_proj and both expert launches have staged
/// modes (the generic ones neither normalise the experts' input nor weigh the folded logits).
pub(crate) fn router_fold(c: &Config, w: &Weights) -> bool {
    w.layers.iter().all(|lw| {
        lw.router_fold != 0
            && matches!(
                mv_mode(&[(lw.o, 0, c.d_model)], c.q_dim()).0,
                MatvecMode::Staged { .. }
            )
            && gate_up_mode(lw, c.d_model).0 != GateUpMode::Generic
            && down_mode(lw, c).0 != DownMode::Generic
    })
}

/// A layer's residual buffers: `x` in and out, and the residual after attention (o_proj's
/// output, the experts' input): `x` itself, updated in place, without the fold. With it o_proj
/// writes `x2` while its router rows still read `x`, and moe_down writes the layer's output
/// back to `x` while its blocks read `x2` (moe.cu fold_weights: every block reads all of it
/// before its wait, so in place a block that started late could read rows another had updated).
pub(crate) fn residual(s: &Scratch, fold: bool) -> (u64, u64) {
    (s.x.ptr, if fold { s.x2.ptr } else { s.x.ptr })
}

/// o_proj (`x_out = r.x + o attn`) with the router's rows as the launch's first n_expert
/// blocks (moe.cu OPROJ_ROUTER_KERNEL): the unscaled logits, the chosen experts' ids and
/// logits. `router` (F32) is only for the bytes read. None where o's mode is not staged (the
/// fold applies only where it is: `router_fold`).
pub(crate) fn o_proj_router(
    o: Qw,
    router: &Qw,
    attn: u64,
    x_out: u64,
    r: RouterFold,
) -> Option<Launch> {
    let (n_expert, q_dim) = (r.n_expert as usize, r.q_dim as usize);
    let ws = [(o, x_out, r.d_model as usize)];
    let o_proj = Mv {
        accumulate: true,
        ..Mv::new(&ws, attn, q_dim)
    };
    let (mv, mode, blocks, bytes) = matvec_params(&o_proj);
    let MatvecMode::Staged { kernel, .. } = mode else {
        return None;
    };
    let router_bytes = weight_bytes(router, n_expert) + (n_expert * q_dim * 4) as u64;
    Some(Launch::new(
        Kernel::OprojRouter(kernel),
        "o_proj",
        (blocks + n_expert as u32, 1, 1),
        THREADS,
        smem_x(q_dim).max(
            ((40 + 2 * n_expert.next_multiple_of(4) + n_expert.max(THREADS as usize)) * 4) as u32,
        ),
        &OprojRouterParams { mv, r },
        bytes + router_bytes,
    ))
}

/// Layer `lw`'s o_proj_router over the step's buffers (`router_fold` said it applies).
pub(crate) fn layer_o_proj_router(
    c: &Config,
    lw: &LayerW,
    s: &Scratch,
    x_in: u64,
    x_out: u64,
) -> Launch {
    let r = RouterFold {
        w: lw.router.data,
        fold: lw.router_fold,
        norm: lw.ffn_norm,
        x: x_in,
        slots: s.router_slots.ptr,
        ids: s.ids.ptr,
        sel: s.topw.ptr,
        epoch: s.router_epoch.ptr,
        n_expert: c.n_expert as i32,
        d_model: c.d_model as i32,
        q_dim: c.q_dim() as i32,
        n_used: c.n_expert_used as i32,
    };
    o_proj_router(lw.o, &lw.router, s.attn.ptr, x_out, r)
        .expect("router_fold checked o's mode")
        .with_l2(s.l2.o_proj(c, lw))
}

/// The chosen experts' FFN over the residual at `x_mid`, added into `x_next` (`residual`):
/// moe_gate_up then moe_down.
pub(crate) fn experts(
    c: &Config,
    lw: &LayerW,
    s: &Scratch,
    fold: bool,
    (x_mid, x_next): (u64, u64),
    out: &mut Vec<Launch>,
) {
    out.push(gate_up(c, lw, s, x_mid));
    out.push(down(c, lw, s, fold, (x_mid, x_next)));
}

/// The chosen experts' ids and weights as the experts' launches read them; `scratch` (where a
/// block keeps them in shared memory, in floats) set by each launch.
fn chosen(c: &Config, s: &Scratch) -> Experts {
    Experts {
        ids: s.ids.ptr,
        weights: s.topw.ptr,
        n_used: c.n_expert_used as i32,
        scratch: 0,
    }
}

/// moe_gate_up: h = silu(gate x) * (up x) for each chosen expert, x the FFN-normalised
/// residual at `x_mid`.
fn gate_up(c: &Config, lw: &LayerW, s: &Scratch, x_mid: u64) -> Launch {
    // The staged modes normalise the residual themselves (moe.cu load_xg_quant): with the fold
    // no router writes xn.
    let (gmode, grpw) = gate_up_mode(lw, c.d_model);
    let g = GateUpParams {
        gate: lw.gate,
        up: lw.up,
        xn: match gmode {
            GateUpMode::Generic => s.xn.ptr,
            _ => x_mid,
        },
        h: s.h.ptr,
        norm: lw.ffn_norm,
        eps: c.rms_eps,
        experts: Experts {
            scratch: (smem_x(c.d_model) / 4) as i32,
            ..chosen(c, s)
        },
        d_ff: c.d_ff_expert as i32,
        rows_per_warp: grpw as i32,
    };
    let units = (c.d_ff_expert as u32).div_ceil(WARPS * grpw as u32);
    let cols = s.gate_up_cols[gmode as usize];
    let grid = (
        if cols == 0 { units } else { units.min(cols) },
        c.n_expert_used as u32,
        1,
    );
    let ffn_rows = c.n_expert * c.d_ff_expert;
    Launch::new(
        Kernel::MoeGateUp(gmode),
        "moe_gate_up",
        grid,
        THREADS,
        gate_up_smem(c),
        &g,
        c.n_expert_used as u64 * (lw.slab[0] + lw.slab[1]),
    )
    .with_l2(s.l2.stream(&[(lw.gate, ffn_rows), (lw.up, ffn_rows)]))
}

/// moe_down: x_next = x_mid + the chosen experts' down h, weighted (by the folded router's
/// logits where `fold`).
fn down(c: &Config, lw: &LayerW, s: &Scratch, fold: bool, (x_mid, x_next): (u64, u64)) -> Launch {
    let (dmode, drpw) = down_mode(lw, c);
    // room for h staged per slot as padded floats (the staged modes keep quantised groups, which
    // take less), then the experts
    let h_floats = c.n_expert_used * (c.d_ff_expert / 32) * 36;
    let d = DownParams {
        down: lw.down,
        h: s.h.ptr,
        x: x_mid,
        out: x_next,
        slots: if fold { s.router_slots.ptr } else { 0 },
        n_expert: c.n_expert as i32,
        norm_topk: c.norm_topk_prob as i32,
        eps: c.rms_eps,
        experts: Experts {
            scratch: h_floats as i32,
            ..chosen(c, s)
        },
        d_model: c.d_model as i32,
        n_used: c.n_expert_used as i32,
        rows_per_warp: drpw as i32,
    };
    let grid = ((c.d_model as u32).div_ceil(WARPS * drpw as u32), 1, 1);
    let smem = (h_floats * 4) as u32 + EXPERTS_SMEM + 32 * 4; // + fold_weights' sums
    Launch::new(
        Kernel::MoeDown(dmode),
        "moe_down",
        grid,
        THREADS,
        smem,
        &d,
        c.n_expert_used as u64 * lw.slab[2],
    )
    .with_l2(s.l2.stream(&[(lw.down, c.n_expert * c.d_model)]))
}

/// o_proj (`x += W_o attn`) and the router as a launch of its own (without the fold): the
/// router with its top-k in one launch where it can (`router_cluster` / `router_topk`, which
/// also write the normalised input to xn for the generic experts' mode), else a matvec and
/// `moe_topk`.
pub(crate) fn o_proj_then_router(
    c: &Config,
    lw: &LayerW,
    s: &Scratch,
    x: u64,
    out: &mut Vec<Launch>,
) {
    let o = [(lw.o, x, c.d_model)];
    let o_proj = Mv {
        accumulate: true,
        ..Mv::new(&o, s.attn.ptr, c.q_dim())
    };
    out.push(matvec("o_proj", &o_proj));
    let with_topk = is_f32(lw.router.ty)
        && c.d_model.is_multiple_of(128)
        && c.d_model <= 2048
        && c.n_expert <= 4096
        && c.n_expert_used <= 32;
    if with_topk {
        let r = RouterParams {
            w: lw.router.data,
            input: x,
            norm: lw.ffn_norm,
            xn_out: s.xn.ptr,
            logits: s.router.ptr,
            ids: s.ids.ptr,
            weights: s.topw.ptr,
            counter: s.counter.ptr,
            n_expert: c.n_expert as i32,
            k: c.d_model as i32,
            n_used: c.n_expert_used as i32,
            norm_topk: c.norm_topk_prob as i32,
            eps: c.rms_eps,
        };
        let (kernel, blocks, threads, smem_floats) =
            if s.router_cluster && c.n_expert <= RC_BLOCKS * RC_WARPS {
                // One cluster: the logits meet in block 0's shared memory (moe.cu).
                let (b, t) = (RC_BLOCKS as u32, 32 * RC_WARPS as u32);
                (Kernel::RouterCluster, b, t, 36 + c.d_model + 2 * c.n_expert)
            } else {
                // 4 rows a block: the 1 MB of router rows spread over 32 SMs instead of 16.
                let b = (c.n_expert as u32).div_ceil(ROUTER_THREADS / 32);
                (
                    Kernel::RouterTopk,
                    b,
                    ROUTER_THREADS,
                    36 + c.d_model + c.n_expert + 4,
                )
            };
        out.push(Launch::new(
            kernel,
            "router_topk",
            (blocks, 1, 1),
            threads,
            (smem_floats * 4) as u32,
            &r,
            weight_bytes(&lw.router, c.n_expert),
        ));
    } else {
        let rows = [(lw.router, s.router.ptr, c.n_expert)];
        let router = Mv {
            norm: lw.ffn_norm,
            eps: c.rms_eps,
            xn_out: s.xn.ptr,
            ..Mv::new(&rows, x, c.d_model)
        };
        out.push(matvec("router", &router));
        let bufs = (s.router.ptr, s.ids.ptr, s.topw.ptr);
        out.push(topk(c, Kernel::MoeTopk, bufs, 1));
    }
}

/// Softmax, top-k and renormalisation of the router logits (moe.cu topk_block), a block for
/// each of `tokens` tokens: the decode's moe_topk or the batched prefill's pf_route.
pub(crate) fn topk(c: &Config, kernel: Kernel, bufs: (u64, u64, u64), tokens: u32) -> Launch {
    let t = topk_params(c, bufs);
    Launch::new(
        kernel,
        kernel.symbol(),
        (tokens, 1, 1),
        TOPK_THREADS,
        0,
        &t,
        0,
    )
}

/// Threads of a top-k launch's block (a token a block): topk_block ranks an expert a thread
/// (each against all n_expert), and bt_route's last block lists an expert a thread. With 32
/// threads a thread ranked 4 of 128 experts, 512 serial comparisons, and bt_route took ~14 us a
/// launch at B = 1 (H200, eager). The ranks, so the choices, are the same at any count.
pub(crate) const TOPK_THREADS: u32 = 128;

/// The top-k's params over the router logits at `logits`, into `ids` and `weights`.
pub(crate) fn topk_params(c: &Config, (logits, ids, weights): (u64, u64, u64)) -> TopkParams {
    TopkParams {
        logits,
        ids,
        weights,
        n_expert: c.n_expert as i32,
        n_used: c.n_expert_used as i32,
        norm_topk: c.norm_topk_prob as i32,
    }
}

//! One decode step as a list of resolved launches, built by op family as the kernels are
//! (matvec.rs, attention.rs, moe.rs, sample.rs mirror kernels/*.cu; modes.rs picks each weight
//! launch's kernel). The setup cache keeps this list (and the graph captured from it) per
//! session; the eager path rebuilds it every token.

mod attention;
mod matvec;
mod modes;
mod moe;
mod sample;
mod scratch;

use q4moe_model::Config;

use crate::kernel::Kernel;
use crate::launch::Launch;
use crate::params::EmbedParams;
use crate::weights::{weight_bytes, Weights};

pub use attention::att_grid;
use attention::attention;
pub(crate) use attention::{att_rows, attn_params, gqa_params, rope_params, split_attention};
pub(crate) use matvec::{looped, matvec, Mv};
use modes::THREADS;
use moe::{experts, layer_o_proj_router, o_proj_then_router, residual, router_fold};
pub(crate) use moe::{o_proj_router, topk, topk_params, TOPK_THREADS};
pub(crate) use sample::{head_argmax, sample};
pub use sample::{sample_config, tail, Choice, Ending};
pub(crate) use scratch::sample_bytes;
pub use scratch::{Kv, Scratch};

/// The whole step for a session's KV and attention lengths up to `reach`: embedding, every
/// layer, then what `ending` says (the head and the token's choice, with the settings in
/// `s.sample_cfg`, or nothing).
pub fn build(
    c: &Config,
    w: &Weights,
    s: &Scratch,
    (kv, reach): (&Kv, usize),
    ending: Ending,
) -> Vec<Launch> {
    let mut out = layers(c, w, s, (kv, reach));
    out.extend(tail(c, w, s, ending));
    out
}

/// The embedding and every layer, for attention lengths up to `reach` (`att_grid`).
pub fn layers(c: &Config, w: &Weights, s: &Scratch, (kv, reach): (&Kv, usize)) -> Vec<Launch> {
    let mut out = Vec::with_capacity(8 * c.n_layer + 1);
    let fold = router_fold(c, w);
    let e = EmbedParams {
        w: w.embd,
        state: s.state.ptr,
        x: s.x.ptr, // every layer's input (residual)
    };
    out.push(Launch::new(
        Kernel::Embed,
        "embed",
        ((c.d_model as u32).div_ceil(THREADS), 1, 1),
        THREADS,
        0,
        &e,
        weight_bytes(&w.embd, 1),
    ));
    for l in 0..c.n_layer {
        layer(c, w, s, kv, (l, reach), fold, &mut out);
    }
    out
}

/// Layer `l`: qkv, attention, o_proj and the router (folded or not), the experts.
fn layer(
    c: &Config,
    w: &Weights,
    s: &Scratch,
    kv: &Kv,
    (l, reach): (usize, usize),
    fold: bool,
    out: &mut Vec<Launch>,
) {
    let lw = &w.layers[l];
    let (x, x_mid) = residual(s, fold);
    let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
    let qkv = [
        (lw.q, s.qkv.ptr, q_dim),
        (lw.k, s.qkv.ptr + 4 * q_dim as u64, kv_dim),
        (lw.v, s.qkv.ptr + 4 * (q_dim + kv_dim) as u64, kv_dim),
    ];
    let stream = s.l2.stream(&qkv.map(|(w, _, rows)| (w, rows)));
    let qkv = Mv {
        norm: lw.attn_norm,
        eps: c.rms_eps,
        ..Mv::new(&qkv, x, c.d_model)
    };
    out.push(matvec("qkv", &qkv).with_l2(stream));
    attention(c, lw, s, kv, (l, reach), out);
    if fold {
        out.push(layer_o_proj_router(c, lw, s, x, x_mid));
    } else {
        o_proj_then_router(c, lw, s, x_mid, out);
    }
    experts(c, lw, s, fold, (x_mid, x), out);
}

//! Resident weights: every matrix stays in its 4-bit (or 6/8-bit) blocks on the device. Q4_0,
//! Q4_K and Q6_K are repacked at load into a 16-byte-aligned nibble plane and an aux plane
//! (repack.rs) so a lane reads one 32-weight block with aligned vector loads; other types keep
//! ggml's block bytes. Norms go up as f32.

use std::ops::Range;

use q4moe_gguf::GgmlType;
use q4moe_model::{Config, Model, QTensor};

use crate::device::Device;
use crate::kernel::Kernel;
use crate::launch::Launch;
use crate::memory::DevBuf;
use crate::params::{FoldBuildParams, Qw, RF_MAX_D_MODEL, RF_MAX_EXPERTS, RF_MAX_Q_DIM};
use crate::repack::{aux_bytes, device_row_bytes, plane_bytes, write_planes};
use crate::{CudaError, CudaOptions, Result};

const ALIGN: usize = 256;

/// Device bytes of `rows` rows of `w` as repacked (for the kernel profile and L2 windows).
pub(crate) fn weight_bytes(w: &Qw, rows: usize) -> u64 {
    let ty = GgmlType::from_id(w.ty as u32).expect("a type the weights were uploaded as");
    (device_row_bytes(ty, w.k as usize) * rows) as u64
}

/// One layer's weights as kernel descriptors and norm pointers.
#[derive(Clone, Debug)]
pub struct LayerW {
    pub attn_norm: u64,
    pub q: Qw,
    pub k: Qw,
    pub v: Qw,
    pub o: Qw,
    pub q_norm: u64,
    pub k_norm: u64,
    pub ffn_norm: u64,
    pub router: Qw,
    pub gate: Qw,
    pub up: Qw,
    pub down: Qw,
    /// Bytes per expert slab of gate, up, down (for the profile's bytes-read).
    pub slab: [u64; 3],
    /// [n_expert, q_dim] f32 (router * ffn_norm) @ attn_output (moe.cu RouterFold), or 0 where
    /// the router is not folded (`router_fold_applies`).
    pub router_fold: u64,
}

pub struct Weights {
    pub buf: DevBuf,
    /// Every layer's `router_fold`, when folded.
    pub folds: Option<DevBuf>,
    pub embd: Qw,
    pub output_norm: u64,
    pub output: Qw,
    pub layers: Vec<LayerW>,
}

/// Where one tensor goes in the single device allocation.
struct Place {
    tensor: QTensor,
    /// Data region; for split types (repack.rs) the nibble plane, followed by `scales`.
    at: Range<usize>,
    scales: usize,
    norm: bool,
}

/// Blocks of 32 weights a Q4_K tensor may have: the expert kernels take the aux plane's
/// offsets in 32 bits (quant.cuh Q4_KPieceT: 20 bytes a super-block of 8 blocks).
const Q4_K_AUX32_BLOCKS: usize = (u32::MAX / 20) as usize * 8;

fn kernel_type(t: &QTensor) -> Result<()> {
    match t.ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::Q6_K => Ok(()),
        GgmlType::Q4_K => {
            let blocks = t.n_bytes() / t.ty.type_size() * 8;
            if blocks > Q4_K_AUX32_BLOCKS {
                return Err(CudaError::Unsupported(format!(
                    "tensor {} has {blocks} Q4_K blocks of 32 weights, more than the CUDA \
                     kernels' {Q4_K_AUX32_BLOCKS}",
                    t.name
                )));
            }
            Ok(())
        }
        other => Err(CudaError::Unsupported(format!(
            "tensor {} has type {other:?}, which the CUDA kernels do not read",
            t.name
        ))),
    }
}

fn plan(model: &Model) -> Result<(Vec<Place>, usize)> {
    let mut all: Vec<(QTensor, bool)> = vec![
        (model.token_embd.clone(), false),
        (model.output_norm.clone(), true),
    ];
    if model.output.range != model.token_embd.range {
        all.push((model.output.clone(), false));
    }
    for l in &model.layers {
        let norms = [&l.attn_norm, &l.attn_q_norm, &l.attn_k_norm, &l.ffn_norm];
        all.extend(norms.iter().map(|t| ((*t).clone(), true)));
        let mats = [
            &l.attn_q,
            &l.attn_k,
            &l.attn_v,
            &l.attn_output,
            &l.ffn_gate_inp,
            &l.ffn_gate_exps,
            &l.ffn_up_exps,
            &l.ffn_down_exps,
        ];
        all.extend(mats.iter().map(|t| ((*t).clone(), false)));
    }
    let mut off = 0usize;
    let mut places = Vec::with_capacity(all.len());
    for (t, norm) in all {
        let n_el: usize = t.dims.iter().product();
        let (len, scales) = if norm {
            (n_el * 4, 0)
        } else {
            kernel_type(&t)?;
            let nb = n_el / 32;
            match aux_bytes(t.ty, nb) {
                Some(aux) => (nb * 16 + aux.next_multiple_of(ALIGN) + ALIGN, off + nb * 16),
                None => (t.n_bytes(), 0),
            }
        };
        let scales = if scales > 0 {
            scales.next_multiple_of(ALIGN)
        } else {
            0
        };
        places.push(Place {
            tensor: t,
            at: off..off + len,
            scales,
            norm,
        });
        off = (off + len).next_multiple_of(ALIGN);
    }
    Ok((places, off))
}

/// Host image of one tensor as the device holds it.
fn device_bytes(model: &Model, p: &Place) -> Vec<u8> {
    let src = model.data(&p.tensor);
    if p.norm {
        return model
            .vector_f32(&p.tensor)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
    }
    let Some((n, a)) = plane_bytes(p.tensor.ty, src.len()) else {
        return src.to_vec();
    };
    let mut out = vec![0u8; p.at.len()];
    let (nibbles, rest) = out.split_at_mut(p.scales - p.at.start);
    write_planes(p.tensor.ty, src, &mut nibbles[..n], &mut rest[..a]);
    out
}

/// Whether o_proj's launch takes the router (moe.cu RouterFold), when `wanted`
/// (CudaOptions::router_fold): an F32 router whose rows fit the router blocks' registers, whose
/// top-k fits in shared memory. step.rs folds the layers only where o_proj and the experts have
/// staged modes as well.
fn router_fold_applies(model: &Model, wanted: bool) -> bool {
    let c = &model.config;
    wanted
        && c.d_model <= RF_MAX_D_MODEL
        && c.q_dim() <= RF_MAX_Q_DIM
        && c.n_expert <= RF_MAX_EXPERTS
        && model
            .layers
            .iter()
            .all(|l| l.ffn_gate_inp.ty == GgmlType::F32)
}

/// Bytes of every layer's router fold.
fn fold_bytes(c: &Config) -> usize {
    c.n_layer * c.n_expert * c.q_dim() * 4
}

/// Launches the build of one router fold, [n_expert, o's k] f32 at `p.out` (moe.cu
/// router_fold_build); `p.router` holds n_expert rows.
pub(crate) fn build_fold(dev: &Device, p: &FoldBuildParams, n_expert: usize) -> Result<()> {
    let grid = ((p.q_dim as u32).div_ceil(256), n_expert as u32, 1);
    dev.launch(&Launch::new(
        Kernel::RouterFoldBuild,
        "router_fold",
        grid,
        256,
        0,
        p,
        0,
    ))
}

/// Builds every layer's router fold on the device.
fn build_folds(dev: &Device, c: &Config, layers: &mut [LayerW]) -> Result<DevBuf> {
    let buf = DevBuf::new(dev, fold_bytes(c))?;
    let per_layer = (c.n_expert * c.q_dim() * 4) as u64;
    for (i, lw) in layers.iter_mut().enumerate() {
        lw.router_fold = buf.ptr + i as u64 * per_layer;
        let p = FoldBuildParams {
            o: lw.o,
            router: lw.router.data,
            norm: lw.ffn_norm,
            out: lw.router_fold,
            d_model: c.d_model as i32,
            q_dim: c.q_dim() as i32,
        };
        build_fold(dev, &p, c.n_expert)?;
    }
    dev.sync()?;
    Ok(buf)
}

/// Checks that weights, KV and scratch fit, then uploads every tensor (with a progress bar
/// where `opts.progress`), and builds the router folds when `opts.router_fold` and they apply.
pub fn upload(
    dev: &Device,
    model: &Model,
    extra_bytes: usize,
    opts: &CudaOptions,
) -> Result<Weights> {
    let (places, total) = plan(model)?;
    let fold = router_fold_applies(model, opts.router_fold);
    let (free, _) = dev.free_mem()?;
    let need = total + extra_bytes + (256 << 20) + if fold { fold_bytes(&model.config) } else { 0 };
    if need > free {
        return Err(CudaError::OutOfMemory { need, free });
    }
    let buf = DevBuf::new(dev, total)?;
    upload_places(
        dev,
        model,
        &buf,
        &places,
        opts.progress && total > (64 << 20),
    )?;
    let find = |t: &QTensor| {
        places
            .iter()
            .find(|p| p.tensor.range == t.range && p.tensor.name == t.name)
            .expect("planned")
    };
    let qw = |t: &QTensor| {
        let p = find(t);
        Qw {
            data: buf.ptr + p.at.start as u64,
            scales: buf.ptr + p.scales as u64,
            ty: t.ty.id() as i32,
            k: t.row_len() as i32,
        }
    };
    let ptr = |t: &QTensor| buf.ptr + find(t).at.start as u64;
    let out_t = if model.output.range != model.token_embd.range {
        &model.output
    } else {
        &model.token_embd
    };
    let mut layers = model
        .layers
        .iter()
        .map(|l| LayerW {
            attn_norm: ptr(&l.attn_norm),
            q: qw(&l.attn_q),
            k: qw(&l.attn_k),
            v: qw(&l.attn_v),
            o: qw(&l.attn_output),
            q_norm: ptr(&l.attn_q_norm),
            k_norm: ptr(&l.attn_k_norm),
            ffn_norm: ptr(&l.ffn_norm),
            router: qw(&l.ffn_gate_inp),
            gate: qw(&l.ffn_gate_exps),
            up: qw(&l.ffn_up_exps),
            down: qw(&l.ffn_down_exps),
            slab: [
                l.ffn_gate_exps.slab_bytes() as u64,
                l.ffn_up_exps.slab_bytes() as u64,
                l.ffn_down_exps.slab_bytes() as u64,
            ],
            router_fold: 0,
        })
        .collect::<Vec<_>>();
    let folds = match fold {
        true => Some(build_folds(dev, &model.config, &mut layers)?),
        false => None,
    };
    let (embd, output_norm, output) = (qw(&model.token_embd), ptr(&model.output_norm), qw(out_t));
    Ok(Weights {
        buf,
        folds,
        embd,
        output_norm,
        output,
        layers,
    })
}

impl Weights {
    /// Device bytes the weights hold: the tensors and the router folds.
    pub fn resident_bytes(&self) -> usize {
        self.buf.bytes + self.folds.as_ref().map_or(0, |f| f.bytes)
    }
}

/// Checks the geometry limits the kernels assume.
pub fn check_config(c: &Config) -> Result<()> {
    let bad = |m: String| Err(CudaError::Unsupported(m));
    if c.head_dim > 512 || !c.head_dim.is_multiple_of(32) {
        return bad(format!(
            "head_dim {} (the kernels need a multiple of 32, at most 512)",
            c.head_dim
        ));
    }
    if c.n_expert > 4096 || c.n_expert_used > 32 {
        return bad(format!(
            "{} experts, {} used (at most 4096 and 32)",
            c.n_expert, c.n_expert_used
        ));
    }
    if !c.d_model.is_multiple_of(32) || !c.d_ff_expert.is_multiple_of(32) {
        return bad("d_model and d_ff_expert must be multiples of 32".into());
    }
    Ok(())
}

/// Repacks and uploads every planned tensor into `buf` (the next tensor repacks, in parallel
/// pieces, while this one uploads), with a progress bar where `progress`.
fn upload_places(
    dev: &Device,
    model: &Model,
    buf: &DevBuf,
    places: &[Place],
    progress: bool,
) -> Result<()> {
    let bar = match progress {
        true => indicatif::ProgressBar::new(places.iter().map(|p| p.at.len() as u64).sum()),
        false => indicatif::ProgressBar::hidden(),
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "uploading weights {bar:40} {bytes}/{total_bytes} {bytes_per_sec}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    std::thread::scope(|scope| -> Result<()> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        scope.spawn(move || {
            for p in places {
                if tx.send(device_bytes(model, p)).is_err() {
                    return; // the upload stopped at an error
                }
            }
        });
        for (p, img) in places.iter().zip(rx) {
            buf.upload(dev, p.at.start, &img)?;
            bar.inc(p.at.len() as u64);
        }
        Ok(())
    })?;
    bar.finish_and_clear();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(ty: GgmlType, blocks: usize) -> QTensor {
        let supers = blocks / (ty.block_size() / 32);
        QTensor {
            name: "blk.0.ffn_gate_exps.weight".into(),
            ty,
            dims: vec![ty.block_size(), supers],
            range: 0..supers * ty.type_size(),
        }
    }

    #[test]
    fn q4_k_tensors_past_the_kernels_aux_offsets_are_refused_by_name() {
        assert!(kernel_type(&tensor(GgmlType::Q4_K, Q4_K_AUX32_BLOCKS)).is_ok());
        let err = kernel_type(&tensor(GgmlType::Q4_K, Q4_K_AUX32_BLOCKS + 8))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("blk.0.ffn_gate_exps.weight") && err.contains("Q4_K blocks"),
            "{err}"
        );
        // The other types' offsets are 64-bit: no such limit.
        for ty in [GgmlType::Q4_0, GgmlType::Q6_K] {
            assert!(kernel_type(&tensor(ty, Q4_K_AUX32_BLOCKS + 8)).is_ok());
        }
    }
}

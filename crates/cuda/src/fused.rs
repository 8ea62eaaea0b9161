//! The fused step (kernels/fused.cu): the step's launch list turned into an op table that one
//! persistent grid runs, with grid-wide barriers between ops. The setup cache builds it once
//! per session key; the graph captured from it holds a single kernel node.

use crate::device::{DevBuf, Device, Kernel, Launch};
use crate::params::{FusedOp, FusedParams, FUSED_PARAM_WORDS, GQA_SMEM_BYTES};
use crate::{CudaError, Result};

const THREADS: u32 = 256;

pub struct FusedStep {
    launch: Launch,
    /// Op names, in order (for the per-op profile).
    names: Vec<&'static str>,
    /// [n_ops] %globaltimer per op start, written when the profile is on.
    stamps: Option<DevBuf>,
    _ops: DevBuf,
    _bar: DevBuf,
}

/// FK_* in fused.cu; None for kernels only the bisecting paths use.
fn kind(k: Kernel) -> Option<i32> {
    Some(match k {
        Kernel::Embed => 0,
        Kernel::Matvec => 1,
        Kernel::AttnGqa => 2,
        Kernel::AttnCombine => 3,
        Kernel::RouterTopk => 4,
        Kernel::MoeGateUp => 5,
        Kernel::MoeDown => 6,
        Kernel::ArgmaxPartial => 7,
        Kernel::ArgmaxFinal => 8,
        _ => return None,
    })
}

/// Q4MOE_CUDA_STAMPS=1: the fused step stamps each op's start, read back after every step.
pub fn stamps_enabled() -> bool {
    std::env::var_os("Q4MOE_CUDA_STAMPS").is_some()
}

impl FusedStep {
    /// The fused form of `launches`, or None when one of them has none.
    pub fn new(dev: &Device, launches: &[Launch]) -> Result<Option<FusedStep>> {
        let Some(kinds) = launches
            .iter()
            .map(|l| kind(l.kernel))
            .collect::<Option<Vec<_>>>()
        else {
            return Ok(None);
        };
        let mut ops = Vec::with_capacity(launches.len());
        for (l, &kind) in launches.iter().zip(&kinds) {
            if l.params.len() > FUSED_PARAM_WORDS || l.block > THREADS {
                return Err(CudaError::Unsupported(format!(
                    "{} does not fit the fused step",
                    l.name
                )));
            }
            let mut op = FusedOp {
                kind,
                nx: l.grid.0 as i32,
                ny: l.grid.1 as i32,
                pad: 0,
                params: [0; FUSED_PARAM_WORDS],
            };
            op.params[..l.params.len()].copy_from_slice(&l.params);
            ops.push(op);
        }
        let ops_buf = DevBuf::new(dev, std::mem::size_of_val(ops.as_slice()))?;
        ops_buf.upload(dev, 0, &ops)?;
        let bar = DevBuf::new(dev, 8)?;
        bar.fill(dev, 0)?;
        let stamps = match stamps_enabled() {
            true => Some(DevBuf::new(dev, 8 * ops.len())?),
            false => None,
        };
        let smem = launches
            .iter()
            .map(|l| l.smem)
            .max()
            .unwrap_or(0)
            .max(GQA_SMEM_BYTES);
        let kernel = match std::env::var("Q4MOE_CUDA_FUSED_BLOCKS").as_deref() {
            Ok("2") => Kernel::StepFused2,
            _ => Kernel::StepFused,
        };
        let blocks = dev.resident_blocks(kernel, THREADS, smem)?;
        if blocks == 0 {
            return Err(CudaError::Unsupported(format!(
                "the fused step ({smem} bytes of shared memory) does not fit on one SM"
            )));
        }
        let p = FusedParams {
            ops: ops_buf.ptr,
            bar: bar.ptr,
            stamps: stamps.as_ref().map_or(0, |s| s.ptr),
            n_ops: ops.len() as i32,
        };
        let bytes = launches.iter().map(|l| l.bytes_read).sum();
        Ok(Some(FusedStep {
            launch: Launch::new(
                kernel,
                "step_fused",
                (blocks, 1, 1),
                THREADS,
                smem,
                &p,
                bytes,
            ),
            names: launches.iter().map(|l| l.name).collect(),
            stamps,
            _ops: ops_buf,
            _bar: bar,
        }))
    }

    pub fn launch(&self) -> &Launch {
        &self.launch
    }

    /// (op name, seconds from its start to the next op's start) of the last step; the last op
    /// has no successor and is left out. Empty when stamps are off. Synchronises the stream.
    pub fn op_times(&self, dev: &Device) -> Result<Vec<(&'static str, f64)>> {
        let Some(st) = &self.stamps else {
            return Ok(Vec::new());
        };
        let mut ns = vec![0u64; self.names.len()];
        st.download(dev, 0, &mut ns)?;
        Ok(self
            .names
            .iter()
            .zip(ns.windows(2))
            .map(|(&n, w)| (n, w[1].saturating_sub(w[0]) as f64 * 1e-9))
            .collect())
    }
}

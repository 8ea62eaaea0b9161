//! The device: context, one stream, the NVRTC-compiled module (cached on disk), raw device
//! buffers and kernel launches with one `#[repr(C)]` params struct per kernel.

use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use q4moe_model::backend::KvType;

use crate::l2::L2Window;
use crate::params::StepState;
use crate::{CudaError, Result};

/// Every kernel the step uses, in one place so lookups happen once at start-up. The
/// weight-reading launches have one kernel per mode (step.rs: `mv_mode`, `gate_up_mode`,
/// `down_mode`; 0 = generic, row by row), so each holds only the code it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    Matvec(u8),
    Embed,
    QkNormRope,
    AttnSplit,
    AttnCombine,
    AttnGqa,
    AttnGqa128x8,
    /// The same shape on tensor cores over the f16 cache (sm_80+).
    AttnGqa128x8Tc,
    MoeTopk,
    RouterTopk,
    RouterCluster,
    MoeGateUp(u8),
    MoeDown(u8),
    /// o_proj with the router folded in, by o_proj's matvec mode (1..=8).
    OprojRouter(u8),
    /// The walking output head with the greedy choice in its tail, by the head's matvec mode
    /// (1..=8; sample.cu head_argmax).
    HeadArgmax(u8),
    RouterFoldBuild,
    ArgmaxPartial,
    ArgmaxFinal,
    StepFused,
    SamplePartial,
    SampleWalk,
    SampleEdge,
    SampleTopk,
    SamplePenalize,
    SampleCount,
    /// An empty dependent launch (probe.cu; benches/launch_chain.rs).
    PdlProbe,
    /// The batched prefill's kernels (prefill.cu).
    PfEmbed,
    PfQuant,
    PfRows,
    PfMma,
    PfF32Rows,
    PfRoute,
    PfLists,
    PfTiles,
    PfCombine,
    PfQkNormRope,
    PfAttnSplit,
    PfAttnCombine,
    PfAttnTc,
    PfAttnTcG16,
}

/// The symbols of the modes, by mode (matvec.cu, moe.cu).
const MATVEC: [&str; 18] = [
    "matvec_generic",
    "matvec_q4_0_1",
    "matvec_q4_0_2",
    "matvec_q4_0_4",
    "matvec_q4_k_1",
    "matvec_q4_k_2",
    "matvec_q6_k_1",
    "matvec_q6_k_2",
    "matvec_q6_k_4",
    "matvec_k_mixed",
    "matvec_q4_0_1_loop",
    "matvec_q4_0_2_loop",
    "matvec_q4_0_4_loop",
    "matvec_q4_k_1_loop",
    "matvec_q4_k_2_loop",
    "matvec_q6_k_1_loop",
    "matvec_q6_k_2_loop",
    "matvec_q6_k_4_loop",
];
/// moe_gate_up's kernels by mode (step.rs `gate_up_mode`): the generic one, then the staged ones.
pub const GATE_UP: [&str; 4] = [
    "moe_gate_up",
    "moe_gate_up_q4_0_1",
    "moe_gate_up_q4_0_2",
    "moe_gate_up_q4_k",
];
const DOWN: [&str; 10] = [
    "moe_down",
    "moe_down_q4_0_2",
    "moe_down_q4_0_6",
    "moe_down_q4_0_8",
    "moe_down_q4_k_2",
    "moe_down_q4_k_6",
    "moe_down_q4_k_8",
    "moe_down_q6_k_2",
    "moe_down_q6_k_6",
    "moe_down_q6_k_8",
];
const OPROJ_ROUTER: [&str; 8] = [
    "o_proj_router_q4_0_1",
    "o_proj_router_q4_0_2",
    "o_proj_router_q4_0_4",
    "o_proj_router_q4_k_1",
    "o_proj_router_q4_k_2",
    "o_proj_router_q6_k_1",
    "o_proj_router_q6_k_2",
    "o_proj_router_q6_k_4",
];
const HEAD_ARGMAX: [&str; 8] = [
    "matvec_q4_0_1_loop_argmax",
    "matvec_q4_0_2_loop_argmax",
    "matvec_q4_0_4_loop_argmax",
    "matvec_q4_k_1_loop_argmax",
    "matvec_q4_k_2_loop_argmax",
    "matvec_q6_k_1_loop_argmax",
    "matvec_q6_k_2_loop_argmax",
    "matvec_q6_k_4_loop_argmax",
];
const SINGLE: [Kernel; 35] = [
    Kernel::Embed,
    Kernel::QkNormRope,
    Kernel::AttnSplit,
    Kernel::AttnCombine,
    Kernel::AttnGqa,
    Kernel::AttnGqa128x8,
    Kernel::AttnGqa128x8Tc,
    Kernel::MoeTopk,
    Kernel::RouterTopk,
    Kernel::RouterCluster,
    Kernel::RouterFoldBuild,
    Kernel::ArgmaxPartial,
    Kernel::ArgmaxFinal,
    Kernel::StepFused,
    Kernel::SamplePartial,
    Kernel::SampleWalk,
    Kernel::SampleEdge,
    Kernel::SampleTopk,
    Kernel::SamplePenalize,
    Kernel::SampleCount,
    Kernel::PdlProbe,
    Kernel::PfEmbed,
    Kernel::PfQuant,
    Kernel::PfRows,
    Kernel::PfMma,
    Kernel::PfF32Rows,
    Kernel::PfRoute,
    Kernel::PfLists,
    Kernel::PfTiles,
    Kernel::PfCombine,
    Kernel::PfQkNormRope,
    Kernel::PfAttnSplit,
    Kernel::PfAttnCombine,
    Kernel::PfAttnTc,
    Kernel::PfAttnTcG16,
];

const N_KERNELS: usize = SINGLE.len()
    + MATVEC.len()
    + GATE_UP.len()
    + DOWN.len()
    + OPROJ_ROUTER.len()
    + HEAD_ARGMAX.len();

impl Kernel {
    pub const ALL: [Kernel; N_KERNELS] = {
        let mut all = [Kernel::Embed; N_KERNELS];
        let mut i = 0;
        while i < SINGLE.len() {
            all[i] = SINGLE[i];
            i += 1;
        }
        let mut m = 0;
        let oproj = MATVEC.len() + GATE_UP.len() + DOWN.len();
        while i < all.len() {
            all[i] = if m < MATVEC.len() {
                Kernel::Matvec(m as u8)
            } else if m < MATVEC.len() + GATE_UP.len() {
                Kernel::MoeGateUp((m - MATVEC.len()) as u8)
            } else if m < oproj {
                Kernel::MoeDown((m - MATVEC.len() - GATE_UP.len()) as u8)
            } else if m < oproj + OPROJ_ROUTER.len() {
                Kernel::OprojRouter((m - oproj + 1) as u8)
            } else {
                Kernel::HeadArgmax((m - oproj - OPROJ_ROUTER.len() + 1) as u8)
            };
            (i, m) = (i + 1, m + 1);
        }
        all
    };
    pub fn symbol(self) -> &'static str {
        match self {
            Kernel::Matvec(m) => MATVEC[m as usize],
            Kernel::MoeGateUp(m) => GATE_UP[m as usize],
            Kernel::MoeDown(m) => DOWN[m as usize],
            Kernel::OprojRouter(m) => OPROJ_ROUTER[m as usize - 1],
            Kernel::HeadArgmax(m) => HEAD_ARGMAX[m as usize - 1],
            Kernel::RouterFoldBuild => "router_fold_build",
            Kernel::Embed => "embed",
            Kernel::QkNormRope => "qk_norm_rope",
            Kernel::AttnSplit => "attn_split",
            Kernel::AttnCombine => "attn_combine",
            Kernel::AttnGqa => "attn_gqa",
            Kernel::AttnGqa128x8 => "attn_gqa_128_8",
            Kernel::AttnGqa128x8Tc => "attn_gqa_128_8_tc",
            Kernel::MoeTopk => "moe_topk",
            Kernel::RouterTopk => "router_topk",
            Kernel::RouterCluster => "router_cluster",
            Kernel::ArgmaxPartial => "argmax_partial",
            Kernel::ArgmaxFinal => "argmax_final",
            Kernel::StepFused => "step_fused",
            Kernel::SamplePartial => "sample_partial",
            Kernel::SampleWalk => "sample_walk",
            Kernel::SampleEdge => "sample_edge",
            Kernel::SampleTopk => "sample_topk",
            Kernel::SamplePenalize => "sample_penalize",
            Kernel::SampleCount => "sample_count",
            Kernel::PdlProbe => "pdl_probe",
            Kernel::PfEmbed => "pf_embed",
            Kernel::PfQuant => "pf_quant",
            Kernel::PfRows => "pf_rows",
            Kernel::PfMma => "pf_mma",
            Kernel::PfF32Rows => "pf_f32rows",
            Kernel::PfRoute => "pf_route",
            Kernel::PfLists => "pf_lists",
            Kernel::PfTiles => "pf_tiles",
            Kernel::PfCombine => "pf_combine",
            Kernel::PfQkNormRope => "pf_qk_norm_rope",
            Kernel::PfAttnSplit => "pf_attn_split",
            Kernel::PfAttnCombine => "pf_attn_combine",
            Kernel::PfAttnTc => "pf_attn_tc",
            Kernel::PfAttnTcG16 => "pf_attn_tc_g16",
        }
    }
}

/// Kernel sources, one file per op family; compiled as one program behind `common.cuh`.
const SOURCES: [(&str, &str); 8] = [
    ("common.cuh", include_str!("../kernels/common.cuh")),
    ("matvec.cu", include_str!("../kernels/matvec.cu")),
    ("attention.cu", include_str!("../kernels/attention.cu")),
    ("moe.cu", include_str!("../kernels/moe.cu")),
    ("sample.cu", include_str!("../kernels/sample.cu")),
    ("fused.cu", include_str!("../kernels/fused.cu")),
    ("probe.cu", include_str!("../kernels/probe.cu")),
    // Last, so the decode kernels' code keeps its place in the module.
    ("prefill.cu", include_str!("../kernels/prefill.cu")),
];

/// Probes the libraries before any cudarc call (cudarc panics when libcuda is missing).
pub fn probe() -> std::result::Result<(), String> {
    // SAFETY: these only try to dlopen the libraries.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("libcuda (the NVIDIA driver library) was not found".into());
    }
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err("libnvrtc (the CUDA runtime compiler) was not found".into());
    }
    let n = CudaContext::device_count().map_err(|e| format!("cuInit/device count failed: {e}"))?;
    if n < 1 {
        return Err("no CUDA device is visible".into());
    }
    Ok(())
}

/// Dynamic shared memory the kernels with large activations may use (less where the GPU
/// allows less).
pub const MAX_DYNAMIC_SMEM: u32 = 200 * 1024;

pub struct Device {
    pub ctx: Arc<CudaContext>,
    pub stream: sys::CUstream,
    funcs: Vec<sys::CUfunction>,
    _module: sys::CUmodule,
    pub name: String,
    /// Launch with programmatic stream serialisation (sm_90+; kernels call griddepcontrol), so a
    /// kernel's weights load while its predecessor finishes. On by default; Q4MOE_CUDA_PDL=0
    /// turns it off (A/B measurements).
    pdl: bool,
    /// Compute capability major (9 = Hopper: TMA bulk copies, the fused step).
    pub sm_major: i32,
    /// Thread block clusters (sm_90+): `router_cluster` instead of router_topk. On by default;
    /// Q4MOE_CUDA_ROUTER_CLUSTER=0 turns it off (A/B measurements).
    pub clusters: bool,
    /// The KV cache's element type the module was compiled for.
    pub kv_type: KvType,
    /// Dynamic shared memory a block of each kernel (Kernel::ALL order) may use, as set.
    dyn_smem: Vec<AtomicU32>,
}

// SAFETY: the raw handles belong to `ctx`, which every entry point binds to its thread first.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl Device {
    /// `kv_type`: the KV cache's element type the attention kernels are compiled for.
    pub fn new(kv_type: KvType) -> Result<Device> {
        probe().map_err(CudaError::Unavailable)?;
        let ctx = CudaContext::new(0)?;
        ctx.bind_to_thread()?;
        let name = ctx.name()?;
        let (maj, min) = ctx.compute_capability()?;
        let image = compiled_module(maj, min, kv_type)?;
        // SAFETY: `image` is a cubin NVRTC produced for this device; the handles stay in ctx.
        let module = unsafe { result::module::load_data(image.as_ptr() as *const c_void)? };
        let funcs = Kernel::ALL
            .iter()
            .map(|k| unsafe {
                result::module::get_function(module, std::ffi::CString::new(k.symbol()).unwrap())
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)?;
        // v5 measured it slower (258.7 vs 271.3 tok/s Q4_0); with v10's smaller kernels it is
        // faster (385.7 vs 371.2, session 5) — see NOTES.md.
        let pdl = maj >= 9 && std::env::var("Q4MOE_CUDA_PDL").map_or(true, |v| v != "0");
        let clusters =
            maj >= 9 && std::env::var("Q4MOE_CUDA_ROUTER_CLUSTER").map_or(true, |v| v != "0");
        let dev = Device {
            ctx,
            stream,
            dyn_smem: funcs.iter().map(|_| AtomicU32::new(0)).collect(),
            funcs,
            _module: module,
            name,
            pdl,
            sm_major: maj,
            clusters,
            kv_type,
        };
        let optin = dev.max_smem_optin()?;
        for &k in &Kernel::ALL {
            if matches!(
                k,
                Kernel::Matvec(_)
                    | Kernel::HeadArgmax(_)
                    | Kernel::OprojRouter(_)
                    | Kernel::MoeGateUp(_)
                    | Kernel::MoeDown(_)
                    | Kernel::AttnGqa
                    | Kernel::AttnGqa128x8
                    | Kernel::AttnGqa128x8Tc
                    | Kernel::SampleWalk
                    | Kernel::PfMma
                    | Kernel::PfAttnTc
                    | Kernel::PfAttnTcG16
            ) {
                // Large activations (d_ff * n_used floats), attention's reservation
                // (att_solo_smem) and the walk's chunks over vocabularies past 8M tokens
                // (step::sample) need more than the default 48 KB; GPUs before Hopper allow
                // less than 200 KB a block (A100 163 KB, Ada 99 KB).
                let room = optin.saturating_sub(dev.static_smem(k)?) as u32;
                dev.set_max_dynamic_smem(k, MAX_DYNAMIC_SMEM.min(room))?;
            } else {
                dev.record_dynamic_smem(k)?;
            }
        }
        Ok(dev)
    }

    /// Remembers the dynamic shared memory launches of `k` may use (launch checks it).
    fn record_dynamic_smem(&self, k: Kernel) -> Result<()> {
        // SAFETY: plain query on a live function.
        let n = unsafe {
            result::function::get_function_attribute(
                self.func(k),
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            )?
        };
        self.dyn_smem[self.index(k)].store(n.max(0) as u32, Ordering::Relaxed);
        Ok(())
    }

    pub fn bind(&self) -> Result<()> {
        Ok(self.ctx.bind_to_thread()?)
    }

    fn index(&self, k: Kernel) -> usize {
        Kernel::ALL.iter().position(|x| *x == k).unwrap()
    }

    pub fn func(&self, k: Kernel) -> sys::CUfunction {
        self.funcs[self.index(k)]
    }

    pub fn sm_count(&self) -> Result<u32> {
        let n = self
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        Ok(n.max(0) as u32)
    }

    /// Shared memory a block may opt in to (static + dynamic).
    pub fn max_smem_optin(&self) -> Result<usize> {
        let n = self.ctx.attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )?;
        Ok(n.max(0) as usize)
    }

    /// Dynamic shared memory that holds `k`'s blocks to one an SM (more than half of an SM's
    /// shared memory with its static part), or 0 where Q4MOE_CUDA_ATT_SOLO=0 or it cannot.
    /// Why: attention's chunk walks load the KV cache, and two blocks on one SM share its
    /// loads, a cost that grows with the context: reserved, Q4_0 at 4,096 context went 408.0 ->
    /// 444.5 tok/s, the bench's context unchanged (NOTES.md session 13).
    pub fn att_solo_smem(&self, k: Kernel) -> Result<u32> {
        if std::env::var("Q4MOE_CUDA_ATT_SOLO").is_ok_and(|v| v == "0") {
            return Ok(0);
        }
        let per_sm = self.ctx.attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
        )?;
        let need = (per_sm.max(0) as usize / 2 + 1).saturating_sub(self.static_smem(k)?) as u32;
        let room = self.dynamic_smem_room(k);
        Ok(if need <= room { need } else { 0 })
    }

    /// (L2 bytes the device may set aside for persisting lines, the largest access-policy
    /// window), 0 where it has no such L2 controls.
    pub fn l2_persist_limits(&self) -> Result<(usize, usize)> {
        let a = |attr| self.ctx.attribute(attr).map(|n| n.max(0) as usize);
        Ok((
            a(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE)?,
            a(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE)?,
        ))
    }

    /// Sets `bytes` of L2 aside for persisting lines; returns what the driver set.
    pub fn set_persisting_l2(&self, bytes: usize) -> Result<usize> {
        let limit = sys::CUlimit::CU_LIMIT_PERSISTING_L2_CACHE_SIZE;
        let mut set = 0usize;
        // SAFETY: plain limit calls on the bound context.
        unsafe {
            sys::cuCtxSetLimit(limit, bytes).result()?;
            sys::cuCtxGetLimit(&mut set, limit).result()?;
        }
        Ok(set)
    }

    /// A `__device__` variable of the module: its address and size.
    pub fn global(&self, name: &str) -> Result<(u64, usize)> {
        let name = std::ffi::CString::new(name).expect("no NUL in a symbol");
        // SAFETY: the module is loaded for the device's lifetime.
        Ok(unsafe { result::module::get_global(self._module, name)? })
    }

    /// Sets `bytes` bytes at `ptr` in stream order.
    pub fn memset_async(&self, ptr: u64, byte: u8, bytes: usize) -> Result<()> {
        // SAFETY: the caller's range lies in one allocation or module variable.
        unsafe { result::memset_d8_async(ptr, byte, bytes, self.stream)? };
        Ok(())
    }

    /// Copies `out.len()` values from `ptr` after the stream's work.
    pub fn download_raw<T: Copy>(&self, ptr: u64, out: &mut [T]) -> Result<()> {
        // SAFETY: the caller's range lies in one allocation or module variable.
        unsafe { result::memcpy_dtoh_async(out, ptr, self.stream)? };
        self.sync()
    }

    /// Dynamic shared memory launches of `k` may use (its attribute as set at start-up).
    pub fn dynamic_smem_room(&self, k: Kernel) -> u32 {
        self.dyn_smem[self.index(k)].load(Ordering::Relaxed)
    }

    /// Static shared memory `k` declares.
    pub fn static_smem(&self, k: Kernel) -> Result<usize> {
        // SAFETY: plain query on a live function.
        let n = unsafe {
            result::function::get_function_attribute(
                self.func(k),
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
            )?
        };
        Ok(n.max(0) as usize)
    }

    /// Lets launches of `k` use `bytes` of dynamic shared memory.
    pub fn set_max_dynamic_smem(&self, k: Kernel, bytes: u32) -> Result<()> {
        // SAFETY: plain attribute on a live function.
        unsafe {
            result::function::set_function_attribute(
                self.func(k),
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )?
        };
        self.record_dynamic_smem(k)
    }

    /// Blocks of `k` (at `block` threads, `smem` dynamic bytes) the whole device keeps resident
    /// at once: the grid a persistent kernel with grid-wide barriers may use.
    pub fn resident_blocks(&self, k: Kernel, block: u32, smem: u32) -> Result<u32> {
        let mut per_sm = 0;
        // SAFETY: plain queries on a live function and device.
        unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut per_sm,
                self.func(k),
                block as i32,
                smem as usize,
            )
            .result()?
        };
        Ok(per_sm.max(0) as u32 * self.sm_count()?)
    }

    /// Launches `k` with one params struct passed by value.
    pub fn launch(&self, l: &Launch) -> Result<()> {
        let i = self.index(l.kernel);
        let (f, room) = (self.funcs[i], self.dyn_smem[i].load(Ordering::Relaxed));
        if l.smem > room {
            return Err(CudaError::Unsupported(format!(
                "{} ({}) needs {} bytes of shared memory a block; this GPU allows {room}",
                l.name,
                l.kernel.symbol(),
                l.smem
            )));
        }
        let mut args = [l.params.as_ptr() as *mut c_void];
        // SAFETY: zeroed attributes are valid "ignored" entries until given an id and value.
        let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n = 0;
        // The fused step never calls griddepcontrol.wait, so it must not start early.
        if self.pdl && !matches!(l.kernel, Kernel::StepFused) {
            attrs[n].id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        if let Some(w) = l.l2 {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW;
            attrs[n].value.accessPolicyWindow = sys::CUaccessPolicyWindow {
                base_ptr: w.base as *mut c_void,
                num_bytes: w.bytes,
                hitRatio: w.hit_ratio,
                hitProp: match w.persist {
                    true => sys::CUaccessProperty::CU_ACCESS_PROPERTY_PERSISTING,
                    false => sys::CUaccessProperty::CU_ACCESS_PROPERTY_STREAMING,
                },
                missProp: sys::CUaccessProperty::CU_ACCESS_PROPERTY_STREAMING,
            };
            n += 1;
        }
        let cfg = sys::CUlaunchConfig {
            gridDimX: l.grid.0,
            gridDimY: l.grid.1,
            gridDimZ: l.grid.2,
            blockDimX: l.block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: l.smem,
            hStream: self.stream,
            attrs: attrs.as_mut_ptr(),
            numAttrs: n as u32,
        };
        // SAFETY: the params bytes mirror the kernel's struct; every pointer in them is a live
        // device allocation owned by the backend for as long as launches may run; the
        // attribute array outlives the call.
        unsafe {
            sys::cuLaunchKernelEx(&cfg, f, args.as_mut_ptr(), std::ptr::null_mut()).result()?
        };
        Ok(())
    }

    /// Milliseconds between two events recorded on the stream around what `work` enqueues.
    pub fn time_ms(&self, work: impl FnOnce() -> Result<()>) -> Result<f32> {
        let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
        // SAFETY: two events of our own on our stream, destroyed before returning.
        unsafe {
            let (e0, e1) = (result::event::create(flags)?, result::event::create(flags)?);
            let timed = (|| {
                result::event::record(e0, self.stream)?;
                work()?;
                result::event::record(e1, self.stream)?;
                result::event::synchronize(e1)?;
                Ok(result::event::elapsed(e0, e1)?)
            })();
            let _ = result::event::destroy(e0);
            let _ = result::event::destroy(e1);
            timed
        }
    }

    pub fn sync(&self) -> Result<()> {
        unsafe { result::stream::synchronize(self.stream)? };
        Ok(())
    }

    pub fn free_mem(&self) -> Result<(usize, usize)> {
        Ok(result::mem_get_info()?)
    }
}

/// One kernel launch, fully resolved: what the setup cache keeps and the eager path rebuilds.
#[derive(Clone)]
pub struct Launch {
    pub kernel: Kernel,
    pub name: &'static str,
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub smem: u32,
    /// The kernel's params struct as bytes (8-byte aligned storage).
    pub params: Vec<u64>,
    /// Weight bytes the launch reads (for the per-kernel profile).
    pub bytes_read: u64,
    /// Its access-policy window over the weights it reads: streaming, or persisting in the
    /// set-aside L2 (l2.rs).
    pub l2: Option<L2Window>,
}

impl Launch {
    pub fn new<P: Copy>(
        kernel: Kernel,
        name: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        p: &P,
        bytes_read: u64,
    ) -> Launch {
        let n = std::mem::size_of::<P>().div_ceil(8);
        let mut params = vec![0u64; n];
        // SAFETY: P is a plain #[repr(C)] struct of integers, floats and u64 pointers.
        unsafe {
            std::ptr::copy_nonoverlapping(
                p as *const P as *const u8,
                params.as_mut_ptr() as *mut u8,
                std::mem::size_of::<P>(),
            )
        };
        Launch {
            kernel,
            name,
            grid,
            block,
            smem,
            params,
            bytes_read,
            l2: None,
        }
    }

    /// The launch with its access-policy window.
    pub fn with_l2(self, l2: Option<L2Window>) -> Launch {
        Launch { l2, ..self }
    }
}

/// Pinned host memory of `len` values for asynchronous read-back (the step state ring, the
/// logits of the host sampler's steps): copies into it need no staging and no page pinning.
/// `mapped` ones are also in the device's address space (`device_ptr`), so kernels write them
/// directly and no copy has to follow the kernel.
pub(crate) struct Pinned<T> {
    ptr: *mut T,
    len: usize,
    device_ptr: u64,
}

impl<T: Copy> Pinned<T> {
    pub(crate) fn new(len: usize) -> Result<Self> {
        Self::alloc(len, false)
    }
    /// Zeroed and mapped into the device's address space.
    pub(crate) fn mapped(len: usize) -> Result<Self> {
        Self::alloc(len, true)
    }
    fn alloc(len: usize, mapped: bool) -> Result<Self> {
        let bytes = len * std::mem::size_of::<T>();
        let flags = if mapped {
            sys::CU_MEMHOSTALLOC_DEVICEMAP
        } else {
            0
        };
        // SAFETY: page-locked allocation of len values, freed once in Drop; a mapped one's
        // device address comes from the driver and is zeroed before any kernel sees it.
        unsafe {
            let ptr = result::malloc_host(bytes, flags)? as *mut T;
            let mut device_ptr = 0;
            if mapped {
                let got = sys::cuMemHostGetDevicePointer_v2(&mut device_ptr, ptr as *mut c_void, 0);
                if let Err(e) = got.result() {
                    let _ = result::free_host(ptr as *mut c_void);
                    return Err(e.into());
                }
                std::ptr::write_bytes(ptr as *mut u8, 0, bytes);
            }
            Ok(Pinned {
                ptr,
                len,
                device_ptr,
            })
        }
    }
    /// The device's address of a `mapped` allocation (0 otherwise).
    pub(crate) fn device_ptr(&self) -> u64 {
        self.device_ptr
    }
    pub(crate) fn all(&mut self) -> &mut [T] {
        // SAFETY: len values allocated in `new`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    /// Ring slot i (modulo len), one value.
    pub(crate) fn slot(&mut self, i: usize) -> &mut [T] {
        let i = i % self.len;
        &mut self.all()[i..i + 1]
    }
}

impl Pinned<StepState> {
    /// Slot i's state read as the device writes it, one 8-byte load (finish_step's store): a
    /// read while the write lands sees the old state or the new one, never half of each.
    pub(crate) fn read_state(&self, i: usize) -> StepState {
        // SAFETY: the slot is within the allocation, 8-byte aligned (page-aligned base).
        let bits = unsafe { std::ptr::read_volatile(self.ptr.add(i % self.len) as *const u64) };
        StepState {
            token: bits as u32,
            pos: (bits >> 32) as u32,
        }
    }
    /// Slot i marked unwritten (position 0, which no step publishes) before the step that
    /// writes it is submitted: a state a step of an earlier decode left there at the same
    /// position is not taken for this one's.
    pub(crate) fn clear(&mut self, i: usize) {
        // SAFETY: as in read_state; no step in flight writes this slot (the ring outlasts them).
        unsafe { std::ptr::write_volatile(self.ptr.add(i % self.len) as *mut u64, 0) };
    }
}

impl<T> Drop for Pinned<T> {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host in `alloc`; the owner keeps the context bound.
        unsafe {
            let _ = result::free_host(self.ptr as *mut _);
        }
    }
}

/// A raw device allocation, freed on drop.
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
    ctx: Arc<CudaContext>,
    /// False for a view into another buffer (`view`), which that buffer frees.
    owned: bool,
}

impl DevBuf {
    pub fn new(dev: &Device, bytes: usize) -> Result<DevBuf> {
        dev.bind()?;
        // SAFETY: plain allocation; size is at least one byte.
        let ptr = unsafe { result::malloc_sync(bytes.max(256))? };
        Ok(DevBuf {
            ptr,
            bytes,
            ctx: dev.ctx.clone(),
            owned: true,
        })
    }
    /// `bytes` at `off` of this buffer as a buffer of their own that frees nothing: its owner
    /// must outlive it.
    pub fn view(&self, off: usize, bytes: usize) -> DevBuf {
        assert!(off + bytes <= self.bytes, "view past the buffer");
        DevBuf {
            ptr: self.ptr + off as u64,
            bytes,
            ctx: self.ctx.clone(),
            owned: false,
        }
    }
    pub fn upload<T: Copy>(&self, dev: &Device, off: usize, data: &[T]) -> Result<()> {
        assert!(
            off + std::mem::size_of_val(data) <= self.bytes.max(256),
            "upload past the buffer"
        );
        unsafe { result::memcpy_htod_async(self.ptr + off as u64, data, dev.stream)? };
        dev.sync()
    }
    pub fn download<T: Copy>(&self, dev: &Device, off: usize, out: &mut [T]) -> Result<()> {
        dev.download_raw(self.ptr + off as u64, out)
    }
    /// Fills with a byte pattern (tests poison outputs with 0xff = NaN floats).
    pub fn fill(&self, dev: &Device, byte: u8) -> Result<()> {
        dev.memset_async(self.ptr, byte, self.bytes)?;
        dev.sync()
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by malloc_sync and freed once.
        unsafe {
            let _ = result::free_sync(self.ptr);
        }
    }
}

/// Options every compile uses; part of the cache key.
fn compile_options(maj: i32, min: i32, kv_type: KvType) -> Vec<String> {
    let mut opts = vec![
        format!("--gpu-architecture=sm_{maj}{min}"),
        "-default-device".into(),
        "--std=c++17".into(),
        "-lineinfo".into(),
    ];
    if kv_type == KvType::F16 {
        opts.push("-DKV_F16".into()); // attention.cu's kv_t
    }
    if crate::timeline::enabled() {
        opts.push("-DQ4MOE_TIMELINE".into()); // common.cuh's pdl_wait probe
    }
    opts
}

fn cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("q4moe").join("kernels")
}

/// The kernel sources in SOURCES order: the embedded ones, or where Q4MOE_CUDA_KERNEL_DIR names
/// a directory, the files of the same names there. That lets one binary time several kernel
/// variants in one device call (scripts/kernel-variants.sh, scripts/gpu-check.sh `variants`).
fn kernel_sources() -> Result<Vec<(&'static str, String)>> {
    kernel_sources_in(
        std::env::var_os("Q4MOE_CUDA_KERNEL_DIR")
            .map(PathBuf::from)
            .as_deref(),
    )
}

fn kernel_sources_in(dir: Option<&std::path::Path>) -> Result<Vec<(&'static str, String)>> {
    let Some(dir) = dir else {
        return Ok(SOURCES.iter().map(|&(n, s)| (n, s.to_string())).collect());
    };
    SOURCES
        .iter()
        .map(|&(n, _)| {
            let path = dir.join(n);
            match std::fs::read_to_string(&path) {
                Ok(s) => Ok((n, s)),
                Err(source) => Err(CudaError::KernelSource { path, source }),
            }
        })
        .collect()
}

/// FNV-1a over sources, architecture and options: a cubin is reused only for the same inputs.
fn source_hash(sources: &[(&str, String)], opts: &[String]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: &[u8]| {
        b.iter()
            .for_each(|&x| h = (h ^ x as u64).wrapping_mul(0x100_0000_01b3))
    };
    sources.iter().for_each(|(n, s)| {
        eat(n.as_bytes());
        eat(s.as_bytes());
    });
    opts.iter().for_each(|o| eat(o.as_bytes()));
    h
}

/// The cubin for this device: from the disk cache, else compiled by NVRTC and stored.
fn compiled_module(maj: i32, min: i32, kv_type: KvType) -> Result<Vec<u8>> {
    let opts = compile_options(maj, min, kv_type);
    let sources = kernel_sources()?;
    let path = cache_dir().join(format!(
        "q4moe-{:016x}-sm{maj}{min}.cubin",
        source_hash(&sources, &opts)
    ));
    if let Ok(bytes) = std::fs::read(&path) {
        return Ok(bytes);
    }
    let cubin = nvrtc_compile(&sources, &opts)?;
    if std::fs::create_dir_all(path.parent().unwrap()).is_ok() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(cubin)
}

fn nvrtc_compile(sources: &[(&str, String)], opts: &[String]) -> Result<Vec<u8>> {
    let src: String = sources
        .iter()
        .map(|(n, s)| format!("// ---- {n}\n{s}\n"))
        .collect();
    let c_src = std::ffi::CString::new(src).unwrap();
    let name = std::ffi::CString::new("q4moe_kernels.cu").unwrap();
    let prog = nvrtc::create_program(&c_src, Some(&name))
        .map_err(|e| CudaError::Compile(format!("{e:?}")))?;
    // SAFETY: `prog` is live until destroyed below.
    unsafe {
        let res = nvrtc::compile_program(prog, opts);
        if res.is_err() {
            let log = nvrtc::get_program_log(prog)
                .map(|l| l.iter().map(|&c| c as u8 as char).collect::<String>());
            let _ = nvrtc::destroy_program(prog);
            return Err(CudaError::Compile(log.unwrap_or_default()));
        }
        let mut size = 0usize;
        nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
            .result()
            .map_err(|e| CudaError::Compile(format!("{e:?}")))?;
        let mut buf = vec![0u8; size];
        nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut _)
            .result()
            .map_err(|e| CudaError::Compile(format!("{e:?}")))?;
        let _ = nvrtc::destroy_program(prog);
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel directory's files replace the embedded sources (and so change the cubin's cache
    /// key); a file missing there is an error that names it.
    #[test]
    fn kernel_dir_replaces_the_sources_and_names_a_missing_file() {
        let dir = std::env::temp_dir().join(format!("q4moe-kernel-dir-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (n, s) in SOURCES {
            std::fs::write(dir.join(n), format!("// variant\n{s}")).unwrap();
        }
        let variant = kernel_sources_in(Some(&dir)).unwrap();
        assert!(variant.iter().all(|(_, s)| s.starts_with("// variant\n")));
        let embedded = kernel_sources_in(None).unwrap();
        assert_ne!(source_hash(&variant, &[]), source_hash(&embedded, &[]));
        std::fs::remove_file(dir.join("moe.cu")).unwrap();
        let err = kernel_sources_in(Some(&dir)).unwrap_err().to_string();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            err.contains("moe.cu") && err.contains("Q4MOE_CUDA_KERNEL_DIR"),
            "{err}"
        );
    }
}

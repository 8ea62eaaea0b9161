//! The device: context, one stream, the loaded module's functions and their properties, and
//! kernel launches with one `#[repr(C)]` params struct per kernel.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use q4moe_model::backend::KvType;

use crate::kernel::Kernel;
use crate::launch::Launch;
use crate::nvrtc;
use crate::{CudaError, CudaOptions, Result};

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
    /// kernel's weights load while its predecessor finishes (v5 measured it slower, 258.7 vs
    /// 271.3 tok/s Q4_0; with v10's smaller kernels faster, 385.7 vs 371.2, session 5).
    pdl: bool,
    /// Compute capability major (9 = Hopper: TMA bulk copies, clusters).
    pub sm_major: i32,
    /// Thread block clusters (sm_90+): `router_cluster` instead of router_topk.
    pub clusters: bool,
    /// The KV cache's element type the module was compiled for.
    pub kv_type: KvType,
    /// Every kernel, `funcs` and `dyn_smem` in its order (Kernel::all).
    kernels: Vec<Kernel>,
    /// Dynamic shared memory a block of each kernel may use, as set.
    dyn_smem: Vec<AtomicU32>,
}

// SAFETY: the raw handles belong to `ctx`, which every entry point binds to its thread first.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl Device {
    /// The first GPU with the kernels compiled (or taken from the cache) for it: the KV cache's
    /// element type, the source directory and the cache's place as `opts` say.
    pub fn new(opts: &CudaOptions) -> Result<Device> {
        probe().map_err(CudaError::Unavailable)?;
        let ctx = CudaContext::new(0)?;
        ctx.bind_to_thread()?;
        let name = ctx.name()?;
        let (maj, min) = ctx.compute_capability()?;
        let kv_type = opts.kv_type;
        let image = nvrtc::compiled_module(&nvrtc::Build {
            arch: (maj, min),
            kv_type,
            kernel_dir: opts.kernel_dir.as_deref(),
            cache_dir: opts.kernel_cache_dir(),
        })?;
        // SAFETY: `image` is a cubin NVRTC produced for this device; the handles stay in ctx.
        let module = unsafe { result::module::load_data(image.as_ptr() as *const c_void)? };
        let kernels = Kernel::all();
        let funcs = kernels
            .iter()
            .map(|k| unsafe {
                let symbol = std::ffi::CString::new(k.symbol()).expect("no NUL in a symbol");
                result::module::get_function(module, symbol)
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)?;
        let dev = Device {
            ctx,
            stream,
            dyn_smem: funcs.iter().map(|_| AtomicU32::new(0)).collect(),
            funcs,
            kernels,
            _module: module,
            name,
            pdl: maj >= 9,
            sm_major: maj,
            clusters: maj >= 9,
            kv_type,
        };
        let optin = dev.max_smem_optin()?;
        for k in dev.kernels.clone() {
            if k.large_smem() {
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
        self.kernels
            .iter()
            .position(|x| *x == k)
            .expect("every kernel is in the table")
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
    /// shared memory with its static part), or 0 where it cannot.
    /// Why: attention's chunk walks load the KV cache, and two blocks on one SM share its
    /// loads, a cost that grows with the context: reserved, Q4_0 at 4,096 context went 408.0 ->
    /// 444.5 tok/s, the bench's context unchanged (docs/performance.md).
    pub fn att_solo_smem(&self, k: Kernel) -> Result<u32> {
        let per_sm = self.ctx.attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
        )?;
        let need = (per_sm.max(0) as usize / 2 + 1).saturating_sub(self.static_smem(k)?) as u32;
        let room = self.dynamic_smem_room(k);
        Ok(if need <= room { need } else { 0 })
    }

    /// The largest access-policy window the device takes (0: no L2 controls).
    pub fn max_l2_window(&self) -> Result<usize> {
        let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE;
        Ok(self.ctx.attribute(attr)?.max(0) as usize)
    }

    /// A `__device__` variable of the module: its address and size.
    #[cfg(feature = "timeline")]
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

    /// Copies `bytes` bytes from `src` to `dst` in stream order.
    pub fn copy_async(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller's ranges lie in allocations of at least `bytes` and do not overlap.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream)? };
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
        if self.pdl {
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
                hitRatio: 1.0,
                hitProp: sys::CUaccessProperty::CU_ACCESS_PROPERTY_STREAMING,
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

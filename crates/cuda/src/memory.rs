//! Device and pinned host memory: `DevBuf` (a raw device allocation) and `Pinned` (page-locked
//! host memory, optionally mapped into the device's address space).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use crate::device::Device;
use crate::params::StepState;
use crate::Result;

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

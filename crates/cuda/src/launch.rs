//! One kernel launch, fully resolved: what the setup cache keeps and the eager path rebuilds.

use crate::kernel::Kernel;

/// A launch's access-policy window (l2.rs): the lines of [base, base + bytes) stream through
/// L2, evicted first, so the step's own data, read again soon, keeps the cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct L2Window {
    pub base: u64,
    pub bytes: usize,
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
    /// Its access-policy window over the weights it reads (l2.rs).
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

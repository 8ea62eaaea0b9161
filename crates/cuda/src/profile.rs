//! The per-kernel profiler (`--profile kernels`, CudaOptions::profile_kernels): the eager path's
//! launches each between two events, their GPU times summed by launch name.

use std::collections::HashMap;
use std::time::Duration;

use cudarc::driver::{result, sys};

use crate::device::Device;
use crate::launch::Launch;
use crate::{KernelTime, Result};

/// (calls, seconds, weight bytes read) of one name.
pub(crate) type Entry = (u64, f64, u64);

#[derive(Default)]
pub(crate) struct Profiler {
    /// An event pair a launch of the longest list timed so far.
    events: Vec<(sys::CUevent, sys::CUevent)>,
    by_name: HashMap<&'static str, Entry>,
}

impl Profiler {
    /// Runs `ls` one by one, each between two events, and adds their times.
    pub fn launch_timed(&mut self, dev: &Device, ls: &[Launch]) -> Result<()> {
        while self.events.len() < ls.len() {
            let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
            let pair = (result::event::create(flags)?, result::event::create(flags)?);
            self.events.push(pair);
        }
        // SAFETY: events of ours, recorded on the device's stream and read after its sync.
        for (l, &(a, b)) in ls.iter().zip(&self.events) {
            unsafe { result::event::record(a, dev.stream)? };
            dev.launch(l)?;
            unsafe { result::event::record(b, dev.stream)? };
        }
        dev.sync()?;
        for (l, &(a, b)) in ls.iter().zip(&self.events) {
            let ms = unsafe { result::event::elapsed(a, b)? };
            let e = self.by_name.entry(l.name).or_insert((0, 0.0, 0));
            e.0 += 1;
            e.1 += ms as f64 * 1e-3;
            e.2 += l.bytes_read;
        }
        Ok(())
    }

    pub fn report(&self) -> Vec<KernelTime> {
        self.by_name
            .iter()
            .map(|(n, e)| kernel_time(n.to_string(), e))
            .collect()
    }

    pub fn reset(&mut self) {
        self.by_name.clear();
    }
}

pub(crate) fn kernel_time(name: String, &(calls, secs, bytes): &Entry) -> KernelTime {
    KernelTime {
        name,
        calls,
        total: Duration::from_secs_f64(secs),
        bytes_read: bytes,
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        // SAFETY: created in launch_timed and destroyed once; the owner keeps the context
        // bound and the stream synchronised before dropping it.
        unsafe {
            for &(a, b) in &self.events {
                let _ = result::event::destroy(a);
                let _ = result::event::destroy(b);
            }
        }
    }
}

//! The in-flight ring of decode submissions: each step's token choice writes the new step
//! state into host-mapped memory (common.cuh finish_step), slot pos % RING, so no
//! device-to-host copy sits between one step and the next in the stream; an event pair a slot
//! times each submission's GPU work, and the host reads a state as it lands.

use std::time::{Duration, Instant};

use cudarc::driver::{result, sys};

use crate::memory::Pinned;
use crate::params::{StepState, STATE_RING};
use crate::{CudaError, Result};

/// Steps whose token can be in flight at once (pinned read-back slots, event pairs); the step
/// at position pos uses slot pos % RING, as the kernels' finish_step publishes it.
pub(crate) const RING: usize = STATE_RING;

fn event() -> Result<sys::CUevent> {
    Ok(result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)?)
}

pub(crate) struct Pipeline {
    /// StepState [RING], host-mapped: the device publishes each step's state here.
    states: Pinned<StepState>,
    /// Per-slot (start, end) events timing each submission's GPU work.
    events: Vec<(sys::CUevent, sys::CUevent)>,
    /// Per slot, the event its submission's GPU time counts from (`begin`).
    timed_from: Vec<sys::CUevent>,
    /// The position of the last step submitted.
    last_submitted: Option<usize>,
}

impl Pipeline {
    pub fn new() -> Result<Pipeline> {
        let events = (0..RING)
            .map(|_| Ok((event()?, event()?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Pipeline {
            states: Pinned::mapped(RING)?,
            timed_from: events.iter().map(|e| e.0).collect(),
            events,
            last_submitted: None,
        })
    }

    /// The device address of the mapped state ring (Scratch::publish).
    pub fn publish_ptr(&self) -> u64 {
        self.states.device_ptr()
    }

    /// Before the work of the steps `first..=last` is queued on `stream`: their slots marked
    /// unwritten, and their GPU time counted from the previous submission's end event where
    /// that is still queued or running (the GPU goes from one to the other: no start event need
    /// sit between them in the stream, ~1.3 us a step), else from a start event of its own.
    pub fn begin(&mut self, stream: sys::CUstream, first: usize, last: usize) -> Result<()> {
        let e0 = self.events[last % RING].0;
        let prev = self.events[(first + RING - 1) % RING].1;
        // SAFETY: events created in `new`, recorded on the backend's stream.
        let busy = self.last_submitted == first.checked_sub(1)
            && unsafe { result::event::query(prev) }
                .is_err_and(|e| e.0 == sys::CUresult::CUDA_ERROR_NOT_READY);
        self.timed_from[last % RING] = if busy { prev } else { e0 };
        if !busy {
            unsafe { result::event::record(e0, stream)? };
        }
        self.last_submitted = Some(last);
        (first..=last).for_each(|p| self.states.clear(p));
        Ok(())
    }

    /// After the work of the submission ending at `last`: its end event.
    pub fn end(&mut self, stream: sys::CUstream, last: usize) -> Result<()> {
        // SAFETY: an event of ours on the backend's stream.
        unsafe { result::event::record(self.events[last % RING].1, stream)? };
        Ok(())
    }

    /// GPU time of the submission whose last step is at `last` (its end event has passed).
    pub fn gpu_time(&self, last: usize) -> Result<Duration> {
        let (e0, e1) = (self.timed_from[last % RING], self.events[last % RING].1);
        // SAFETY: both events recorded, the end one completed.
        let ms = unsafe { result::event::elapsed(e0, e1)? };
        Ok(Duration::from_secs_f64(ms as f64 * 1e-3))
    }

    /// Waits for the submission whose last step is at position `pos`; returns that step's
    /// state and the submission's GPU time.
    pub fn wait(&self, pos: usize) -> Result<(StepState, Duration)> {
        // SAFETY: an event of ours, recorded after the submission.
        unsafe { result::event::synchronize(self.events[pos % RING].1)? };
        Ok((self.read_state(pos)?, self.gpu_time(pos)?))
    }

    /// The state the finished step at position `pos` published, which must be its own
    /// (position pos + 1): a mapped write that has not arrived yet is waited for (briefly),
    /// anything else is an error, not a token.
    fn read_state(&self, pos: usize) -> Result<StepState> {
        let want = pos as u32 + 1;
        let t0 = Instant::now();
        let mut st = self.states.read_state(pos);
        while st.pos != want && t0.elapsed() < Duration::from_secs(1) {
            std::hint::spin_loop();
            st = self.states.read_state(pos);
        }
        if st.pos != want {
            return Err(CudaError::ReadBack(format!(
                "the step at position {pos} read back a state of position {} (want {want})",
                st.pos
            )));
        }
        Ok(st)
    }

    /// The state of the step at position `pos`, published by its token choice, where a later
    /// step of the same graph (ending at `last`) holds the end event: read as it lands, the
    /// graph's end event queried now and then so an error or a missing write is reported, not
    /// waited for.
    pub fn wait_published(&self, pos: usize, last: usize) -> Result<StepState> {
        let end = self.events[last % RING].1;
        let want = pos as u32 + 1;
        let mut polls = 0u32;
        loop {
            let st = self.states.read_state(pos);
            if st.pos == want {
                return Ok(st);
            }
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(1024) {
                // SAFETY: an event of ours, recorded after the graph.
                match unsafe { result::event::query(end) } {
                    Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => {}
                    Err(e) => return Err(e.into()),
                    // The graph is done: its write has had its time.
                    Ok(()) => return self.read_state(pos),
                }
            }
            std::hint::spin_loop();
        }
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        // SAFETY: created in `new` and destroyed once; the owner keeps the context bound and
        // the stream synchronised before dropping it.
        unsafe {
            for &(a, b) in &self.events {
                let _ = result::event::destroy(a);
                let _ = result::event::destroy(b);
            }
        }
    }
}

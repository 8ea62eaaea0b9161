//! A captured whole-step CUDA graph (instantiated once per session key, replayed per token).

use cudarc::driver::{result, sys};

use crate::device::Device;
use crate::launch::Launch;
use crate::Result;

pub struct Graph {
    /// The captured template, kept alive with its instantiation.
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

// SAFETY: graph handles are plain driver handles used under the backend's context.
unsafe impl Send for Graph {}

impl Graph {
    /// Captures `launches` on the device's stream.
    pub fn capture<'a>(
        dev: &Device,
        launches: impl IntoIterator<Item = &'a Launch>,
    ) -> Result<Graph> {
        // SAFETY: the stream is ours and idle; the launches only reference live allocations.
        unsafe {
            result::stream::begin_capture(
                dev.stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )?;
            let launched = launches.into_iter().try_for_each(|l| dev.launch(l));
            let graph = result::stream::end_capture(dev.stream)?;
            launched?;
            let exec = result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0))?;
            Ok(Graph { graph, exec })
        }
    }

    pub fn launch(&self, dev: &Device) -> Result<()> {
        // SAFETY: exec is live; it runs on our stream.
        unsafe { result::graph::launch(self.exec, dev.stream)? };
        Ok(())
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: destroyed once; the context is bound by the owner before dropping sessions.
        unsafe {
            let _ = result::graph::exec_destroy(self.exec);
            let _ = result::graph::destroy(self.graph);
        }
    }
}

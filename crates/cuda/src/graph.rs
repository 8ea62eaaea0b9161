//! A captured whole-step CUDA graph (instantiated once per session key, replayed per token).

use cudarc::driver::{result, sys};

use crate::device::{Device, Launch};
use crate::Result;

pub struct Graph {
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

    /// Gives every kernel node that runs `func` the grid `grid`, in the instantiated graph and
    /// in the template it came from, without capturing again: a replay already queued keeps the
    /// grid it had, later replays take the new one. Returns the nodes changed. Why: the
    /// attention's grid follows the positions a graph reaches (step::att_grid), and capturing
    /// and instantiating the step again each time it grows cost ~1.7 ms at the full geometry
    /// with 4 steps a graph (session 38's record: host setup 1.2-1.5% of the wall).
    pub fn regrid(&mut self, func: sys::CUfunction, grid: (u32, u32, u32)) -> Result<usize> {
        // SAFETY: the graph and exec are live; the node params read back are the driver's own,
        // set again unchanged apart from the grid.
        unsafe {
            let mut n = 0usize;
            sys::cuGraphGetNodes(self.graph, std::ptr::null_mut(), &mut n).result()?;
            let mut nodes = vec![std::ptr::null_mut(); n];
            sys::cuGraphGetNodes(self.graph, nodes.as_mut_ptr(), &mut n).result()?;
            let mut changed = 0;
            for &node in &nodes[..n] {
                let mut ty = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
                sys::cuGraphNodeGetType(node, &mut ty).result()?;
                if ty != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
                    continue;
                }
                let mut p: sys::CUDA_KERNEL_NODE_PARAMS = std::mem::zeroed();
                sys::cuGraphKernelNodeGetParams_v2(node, &mut p).result()?;
                if p.func != func {
                    continue;
                }
                (p.gridDimX, p.gridDimY, p.gridDimZ) = grid;
                sys::cuGraphKernelNodeSetParams_v2(node, &p).result()?;
                sys::cuGraphExecKernelNodeSetParams_v2(self.exec, node, &p).result()?;
                changed += 1;
            }
            Ok(changed)
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

//! The setup cache (DESIGN.md section 4): per session, the step's resolved launches and the
//! graph captured from them, reused while the key they were built for still holds. A backend
//! serves one model, so the geometry is not part of the key.

use q4moe_model::backend::SessionId;
use q4moe_model::Config;

use crate::device::Device;
use crate::graph::Graph;
use crate::step::{self, Ending, Kv, Scratch};
use crate::weights::Weights;
use crate::Result;

/// What a cached setup is valid for: plain values, compared on every submission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SessionKey {
    pub session: SessionId,
    /// The session's KV capacity now (it grows: CudaOptions::kv_grow_from).
    pub kv_capacity: usize,
    /// What the step runs after its layers.
    pub ending: Ending,
    /// Steps the graph runs one after another (CudaOptions::graph_steps).
    pub steps: usize,
    /// Attention's blocks a KV head for the positions the steps reach (step::att_grid).
    pub att_grid: usize,
}

/// The setup cache entry: the graph captured from the step's resolved launches (it holds
/// their params; the launches are not needed again).
pub(crate) struct StepCache {
    pub key: SessionKey,
    pub graph: Graph,
}

impl StepCache {
    /// Builds the launches of `key.steps` steps over `kv` for attention lengths up to `reach`
    /// and captures them as one graph: the steps repeat the same launches, each reading its
    /// token and position from the device's step state, which the one before advanced.
    pub fn capture(
        dev: &Device,
        (c, w, s): (&Config, &Weights, &Scratch),
        kv: &Kv,
        key: SessionKey,
        reach: usize,
    ) -> Result<StepCache> {
        let launches = step::build(c, w, s, (kv, reach), key.ending);
        let graph = Graph::capture(
            dev,
            std::iter::repeat_n(launches.iter(), key.steps).flatten(),
        )?;
        Ok(StepCache { key, graph })
    }
}

pub(crate) struct Session {
    pub kv: Kv,
    /// Positions the KV holds.
    pub len: usize,
    /// At most one entry per step variant (Ending, steps): prefill and a sampled decode
    /// alternate without rebuilding.
    cache: Vec<StepCache>,
}

impl Session {
    pub fn new(kv: Kv) -> Session {
        Session {
            kv,
            len: 0,
            cache: Vec::new(),
        }
    }

    /// A new (grown) KV: the captured steps held the old one's addresses, so they go.
    pub fn replace_kv(&mut self, kv: Kv) {
        self.kv = kv;
        self.cache.clear();
    }

    /// The entry built for `key`, if any.
    pub fn lookup(&self, key: &SessionKey) -> Option<usize> {
        self.cache.iter().position(|c| c.key == *key)
    }

    pub fn entry(&self, i: usize) -> &StepCache {
        &self.cache[i]
    }

    /// Stores `entry`, replacing a stale one of the same variant (its grid or options
    /// changed); returns its index.
    pub fn insert(&mut self, entry: StepCache) -> usize {
        let k = entry.key;
        self.cache
            .retain(|c| c.key.ending != k.ending || c.key.steps != k.steps);
        self.cache.push(entry);
        self.cache.len() - 1
    }
}

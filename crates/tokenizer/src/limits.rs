//! Limits on rendering a chat template, which comes from the model file and may be hostile: a
//! loop nest that never ends, output of gigabytes, or intermediate values that grow without
//! bound (a string doubled in a loop, a lazily repeated sequence) where neither fuel nor the
//! output limit sees them.

use std::io;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What one render may spend. The defaults are far above what real templates need (Qwen3's
/// template with 100 messages and tools uses a few percent of the fuel, under 1 MiB of output
/// and a few milliseconds).
///
/// Fuel and output bound every render. Memory and time are bounded only where the template
/// renders in a worker process ([`crate::TemplateIsolation::Workers`]): minijinja has no hook
/// on the values its operators build, and a render in this process cannot be stopped midway.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateLimits {
    /// Template instructions one render may execute (minijinja's fuel).
    pub fuel: u64,
    /// Bytes one render may output; also bounds what Python string methods may build.
    pub max_output_bytes: usize,
    /// The worker's address space in bytes (its own code and libraries included).
    pub max_memory_bytes: usize,
    /// Wall-clock time one render may take in a worker.
    pub max_time: Duration,
}

impl Default for TemplateLimits {
    fn default() -> Self {
        Self {
            fuel: 5_000_000,
            max_output_bytes: 16 << 20,
            max_memory_bytes: 1 << 30,
            max_time: Duration::from_secs(2),
        }
    }
}

/// Which limit a render hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TemplateLimit {
    Fuel(u64),
    OutputBytes(usize),
    MemoryBytes(usize),
    Time(Duration),
}

impl std::fmt::Display for TemplateLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Fuel(n) => write!(f, "fuel limit of {n} instructions"),
            Self::OutputBytes(n) => write!(f, "output limit of {n} bytes"),
            Self::MemoryBytes(n) if n % (1 << 20) == 0 => {
                write!(f, "memory limit of {} MiB", n >> 20)
            }
            Self::MemoryBytes(n) => write!(f, "memory limit of {n} bytes"),
            Self::Time(t) => write!(f, "time limit of {} ms", t.as_millis()),
        }
    }
}

/// Collects rendered output and fails the write that would pass `max` bytes, so the render stops
/// there instead of growing a huge string.
pub(crate) struct LimitedBuf {
    pub(crate) buf: Vec<u8>,
    max: usize,
    pub(crate) exceeded: bool,
}

impl LimitedBuf {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            buf: Vec::new(),
            max,
            exceeded: false,
        }
    }
}

impl io::Write for LimitedBuf {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.buf.len() + data.len() > self.max {
            self.exceeded = true;
            return Err(io::Error::other("template output limit exceeded"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

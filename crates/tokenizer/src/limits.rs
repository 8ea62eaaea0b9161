//! Limits on rendering a chat template, which comes from the model file and may be hostile: a
//! loop nest that never ends, or output of gigabytes.

use std::io;

/// What one render may spend. The defaults are far above what real templates need (Qwen3's
/// template with 100 messages and tools uses a few percent of the fuel and under 1 MiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TemplateLimits {
    /// Template instructions one render may execute (minijinja's fuel).
    pub fuel: u64,
    /// Bytes one render may output; also bounds what Python string methods may build.
    pub max_output_bytes: usize,
}

impl Default for TemplateLimits {
    fn default() -> Self {
        Self {
            fuel: 5_000_000,
            max_output_bytes: 16 << 20,
        }
    }
}

/// Which limit a render hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateLimit {
    Fuel(u64),
    OutputBytes(usize),
}

impl std::fmt::Display for TemplateLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Fuel(n) => write!(f, "fuel limit of {n} instructions"),
            Self::OutputBytes(n) => write!(f, "output limit of {n} bytes"),
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

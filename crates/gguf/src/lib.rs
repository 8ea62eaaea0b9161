//! GGUF v3 container: memory-mapped reading with zero-copy tensor views, streaming writing,
//! and the quantised block formats q4moe computes on (`quant`).

// `x % n == 0` rather than `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

mod error;
pub mod quant;
mod reader;
mod types;
mod value;
mod writer;

pub use error::GgufError;
pub use reader::{parse_header, GgufFile, GgufHeader, TensorView};
pub use types::{GgmlType, TensorInfo};
pub use value::{Value, ValueType};
pub use writer::GgufWriter;

pub type Result<T> = std::result::Result<T, GgufError>;

/// `GGUF` in little-endian byte order.
pub const GGUF_MAGIC: u32 = 0x4655_4747;
pub const GGUF_VERSION: u32 = 3;
pub const DEFAULT_ALIGNMENT: u64 = 32;

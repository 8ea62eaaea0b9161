//! The model description every backend reads: `Config` (geometry, parsed and validated once
//! from GGUF metadata), tensor bindings (`Model`), the backend contract, host sampling, and the
//! synthetic model writer.

pub mod backend;
mod config;
pub mod constraint;
mod error;
mod model;
pub mod sampling;
pub mod synth;
mod tokenizer_meta;

pub use config::{Arch, Config};
pub use error::ModelError;
pub use model::{LayerTensors, Model, QTensor};
pub use tokenizer_meta::{spec_from_gguf, spec_to_metadata};

pub type Result<T> = std::result::Result<T, ModelError>;

//! The engine's error type.

use std::path::PathBuf;

/// Why the engine could not start, load a model or serve a request.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A model folder is incomplete or describes something we do not run:
    /// names the file and the field (or tensor).
    #[error("{}: {field}: {why}", file.display())]
    Model {
        file: PathBuf,
        field: String,
        why: String,
    },
    /// A file could not be read.
    #[error("cannot read {}: {why}", file.display())]
    Io { file: PathBuf, why: String },
    /// A request that cannot be served as asked (the HTTP layer answers 400).
    #[error("{0}")]
    BadRequest(String),
    /// The engine is at its limits (the HTTP layer answers 503).
    #[error("{0}")]
    Busy(String),
    /// The tensor library failed.
    #[error("tensor: {0}")]
    Tensor(#[from] candle_core::Error),
    /// A streamed KV group did not arrive for every loaded chunk: only the
    /// first `keep` chunks can be used; the scheduler recomputes the rest.
    #[error("streamed KV lost from chunk {keep} on")]
    KvLost { keep: usize },
    /// Start-up or serving failed for another reason.
    #[error("{0}")]
    Start(String),
}

impl EngineError {
    pub(crate) fn model(
        file: impl Into<PathBuf>,
        field: impl Into<String>,
        why: impl Into<String>,
    ) -> Self {
        Self::Model {
            file: file.into(),
            field: field.into(),
            why: why.into(),
        }
    }
}

//! Errors of the simulator, its plots and its command line (a module of
//! their own: the plots draw the simulator's series, and the simulator's
//! error wraps the plots' error).

use kvpool_conductor::cost::ConfigError;

/// Errors of the simulator and its command line.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The trace could not be loaded.
    #[error(transparent)]
    Trace(#[from] crate::trace::TraceError),
    /// The cost model could not be loaded.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A bad argument.
    #[error("{0}")]
    InvalidArg(String),
    /// Output could not be written.
    #[error("cannot write output: {0}")]
    Output(#[from] std::io::Error),
    /// The plot could not be drawn.
    #[error(transparent)]
    Plot(#[from] PlotError),
}

/// Error of drawing or writing the plot.
#[derive(Debug, thiserror::Error)]
#[error("cannot draw plot {path}: {message}")]
pub struct PlotError {
    /// Output file.
    pub path: String,
    /// What went wrong.
    pub message: String,
}

//! The one dispatch of `kvpool run --role`: every role of
//! [`kvpool_config::Role`], started from its configuration.

use kvpool_config::{NodeConfig, NodeError, Role};
use kvpool_runtime::Shutdown;
use kvpool_serving::proxy::ProxyRole;

use crate::process::{self, Serving};

/// What a role needs beyond its configuration (the CLI's flags that are not
/// configuration keys).
#[derive(Debug, Clone, Default)]
pub struct Launch {
    /// Role engine: the model (a Hugging Face folder, `builtin:tiny`,
    /// `builtin:small`).
    pub model: Option<String>,
    /// Role engine: its listen address (default 127.0.0.1:8000).
    pub engine_listen: Option<String>,
    /// Role engine: the pool's master, if it uses one.
    pub engine_master: Option<String>,
    /// Role all: start the serving path beside the pool.
    pub serving: bool,
    /// Role all: the serving path on free ports too.
    pub ephemeral: bool,
}

/// Runs `role` until SIGINT or SIGTERM (or `shutdown`, for the pool's and
/// the serving roles).
pub fn launch(
    role: Role,
    cfg: NodeConfig,
    opts: Launch,
    shutdown: Shutdown,
) -> Result<(), NodeError> {
    let serving_err = |e: kvpool_serving::ServeError| NodeError::Start(e.to_string());
    match role {
        Role::All | Role::Master | Role::Storage | Role::Gateway => {
            let serving = (role == Role::All && opts.serving).then_some(Serving {
                ephemeral: opts.ephemeral,
            });
            process::run_with(role, cfg, shutdown, serving)
        }
        Role::Engine => {
            let model = opts.model.ok_or_else(|| {
                NodeError::Start(
                    "--role engine needs --model DIR|builtin:tiny|builtin:small".into(),
                )
            })?;
            kvpool_engine::serve::run(kvpool_engine::serve::ServeOptions {
                model,
                listen: opts
                    .engine_listen
                    .unwrap_or_else(|| "127.0.0.1:8000".into()),
                master: opts.engine_master,
                config: cfg,
            })
            .map_err(|e| NodeError::Start(e.to_string()))
        }
        Role::Conductor => kvpool_serving::roles::run_conductor(cfg, shutdown).map_err(serving_err),
        Role::PrefillProxy => {
            kvpool_serving::roles::run_proxy(ProxyRole::Prefill, cfg, shutdown).map_err(serving_err)
        }
        Role::DecodeProxy => {
            kvpool_serving::roles::run_proxy(ProxyRole::Decode, cfg, shutdown).map_err(serving_err)
        }
    }
}

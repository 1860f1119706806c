//! Settings from Python: `kvpool.Client(**options)` are `[client]` keys of
//! kvpool's config (an unknown key is an error naming it); the Mooncake
//! store reads a whole kvpool config file from `KVPOOL_CONFIG` when it is
//! set. The cluster secret comes from `KVPOOL_SECRET` unless given.

use kvpool_config::{ClientConfig, NodeConfig, Secret, SECRET_ENV};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

/// The environment variable naming a kvpool config file (TOML) for the
/// Mooncake store: `[client]`, `[storage]` (the embedded node),
/// `[runtime]`, `[security]`.
pub const CONFIG_ENV: &str = "KVPOOL_CONFIG";

fn to_toml(v: &Bound<'_, PyAny>, key: &str) -> PyResult<toml::Value> {
    if v.is_instance_of::<PyBool>() {
        return Ok(toml::Value::Boolean(v.extract()?));
    }
    if v.is_instance_of::<PyInt>() {
        return Ok(toml::Value::Integer(v.extract()?));
    }
    if v.is_instance_of::<PyFloat>() {
        return Ok(toml::Value::Float(v.extract()?));
    }
    if v.is_instance_of::<PyString>() {
        return Ok(toml::Value::String(v.extract()?));
    }
    if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        let mut out = Vec::new();
        for item in v.try_iter()? {
            out.push(to_toml(&item?, key)?);
        }
        return Ok(toml::Value::Array(out));
    }
    if let Ok(d) = v.cast::<PyDict>() {
        return Ok(toml::Value::Table(to_table(d, key)?));
    }
    Err(PyTypeError::new_err(format!(
        "option {key:?}: a {} is not a config value (bool, int, float, str, list, dict)",
        v.get_type().name()?
    )))
}

fn to_table(d: &Bound<'_, PyDict>, prefix: &str) -> PyResult<toml::Table> {
    let mut t = toml::Table::new();
    for (k, v) in d.iter() {
        let k: String = k
            .extract()
            .map_err(|_| PyTypeError::new_err("option names must be strings"))?;
        let path = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        t.insert(k, to_toml(&v, &path)?);
    }
    Ok(t)
}

/// `[client]` settings from keyword options (plus `secret`).
pub fn client_options(options: Option<&Bound<'_, PyDict>>) -> PyResult<ClientConfig> {
    let mut secret = std::env::var(SECRET_ENV).unwrap_or_default();
    let mut table = toml::Table::new();
    if let Some(d) = options {
        let d = d.copy()?;
        if let Some(s) = d.get_item("secret")? {
            secret = s.extract()?;
            d.del_item("secret")?;
        }
        table = to_table(&d, "")?;
    }
    let text = toml::to_string(&table).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let mut cfg: ClientConfig =
        kvpool_runtime::config::from_toml_str(&text, "kvpool.Client options")
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
    cfg.secret = Secret::new(secret);
    Ok(cfg)
}

/// The config of the Mooncake store: `KVPOOL_CONFIG`'s file or the
/// defaults, with `KVPOOL_SECRET` applied.
pub fn node_config() -> Result<NodeConfig, String> {
    let mut cfg = match std::env::var(CONFIG_ENV) {
        Ok(path) if !path.is_empty() => {
            let text =
                std::fs::read_to_string(&path).map_err(|e| format!("{CONFIG_ENV}={path}: {e}"))?;
            NodeConfig::from_toml(&text, &path).map_err(|e| e.to_string())?
        }
        _ => NodeConfig::default(),
    };
    cfg.apply_env();
    Ok(cfg)
}

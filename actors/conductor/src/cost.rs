//! The cluster cost model: how long prefill, KV fetches and decode steps
//! take, and how big the queues and the decode KV space are.
//!
//! Loaded from TOML (every key optional, defaults below); an unknown key or a
//! value of the wrong type is an error that names the key, and
//! [`CostModel::validate`] rejects values out of range, again naming the key.
//!
//! Formulas (times in ms):
//!
//! ```text
//! prefill(u uncached, c cached) = prefill.base_ms
//!                               + prefill.ms_per_token * u
//!                               + prefill.ms_per_token_sq * u * (u + 2c)
//! fetch(t tokens)               = t * network.kv_bytes_per_token * 8 / (network.link_gbps * 1e9) * 1e3
//! decode_step(b seqs, k tokens) = decode.base_ms + decode.ms_per_seq * b
//!                               + decode.ms_per_1k_context_tokens * k / 1000
//! ```
//!
//! The prefill formula is FLOPs(n) - FLOPs(p) of the Mooncake FAST'25 paper's
//! Equation 1, FLOPs(n) = l (a n^2 d + b n d^2), divided by an effective GPU
//! throughput: with n = c + u and p = c, n^2 - p^2 = u (u + 2c). The linear
//! term is the MLP and projections of the new tokens, the quadratic one their
//! attention over the whole context.
//!
//! Defaults: a LLaMA3-70B-like model on one 8 x A800-80GB node per instance,
//! the paper's Table 1 (l = 80, d = 8192, a = 4, b = 22, G = 8 x 312 TFLOPS,
//! 800 Gbps of NICs), at an assumed 50 % of peak FLOPs for prefill and 60 %
//! of peak HBM bandwidth (8 x 2.04 TB/s) for decode:
//!
//! - `ms_per_token` = l b d^2 / (0.5 G) = 0.0946 ms
//! - `ms_per_token_sq` = l a d / (0.5 G) = 2.10e-6 ms
//! - decode `base_ms` = 141 GB of BF16 weights / 9.8 TB/s = 14.4 ms, plus
//!   launch overhead, rounded to 15 ms
//! - `ms_per_1k_context_tokens` = 1000 x 320 KiB of KV / 9.8 TB/s = 0.0334 ms
//! - `kv_bytes_per_token` = 80 layers x 2 (K, V) x 8 KV heads x 128 x 2 B = 327,680
//! - `max_context_tokens` = (640 GB HBM - 141 GB weights - ~50 GB workspace)
//!   / 320 KiB = ~1.37 M tokens, rounded down to 1.3 M
//! - prefill `local_cache_blocks` = 3 M tokens of DRAM per node (the paper's
//!   local-cache setting, ~1 TB) / 512 = 5,859, rounded to 6,000

use std::fs;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::cache::Capacity;

/// Errors of cost-model loading and validation.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The TOML is malformed, has an unknown key, or a value of the wrong type.
    /// The message names the key and shows the offending line.
    #[error("config {origin}: {message}")]
    Toml { origin: String, message: String },
    /// A value is out of range.
    #[error("config key `{key}`: {reason}")]
    Invalid { key: &'static str, reason: String },
}

/// Prefill instance costs and limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefillCost {
    /// Fixed cost of one prefill (scheduling, launch), ms.
    pub base_ms: f64,
    /// Linear cost per uncached token, ms.
    pub ms_per_token: f64,
    /// Quadratic (attention) cost per uncached token per context token, ms;
    /// multiplies `u * (u + 2 * cached)`.
    pub ms_per_token_sq: f64,
    /// Most requests waiting in one prefill instance's queue.
    pub queue_max: usize,
    /// Blocks the instance's own DRAM cache holds (LRU), or "inf".
    pub local_cache_blocks: Capacity,
}

impl Default for PrefillCost {
    fn default() -> Self {
        Self {
            base_ms: 30.0,
            ms_per_token: 0.0946,
            ms_per_token_sq: 2.10e-6,
            queue_max: 256,
            local_cache_blocks: Capacity::Blocks(6_000),
        }
    }
}

/// Decode instance costs and limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DecodeCost {
    /// Fixed cost of one decode step (weights read), ms.
    pub base_ms: f64,
    /// Cost per sequence in the batch per step, ms.
    pub ms_per_seq: f64,
    /// Cost per 1,000 context tokens in the batch per step (KV read), ms.
    pub ms_per_1k_context_tokens: f64,
    /// Most sequences in one batch.
    pub max_batch: usize,
    /// Most context tokens (KV) resident on one decode instance.
    pub max_context_tokens: u64,
    /// Most prefilled requests waiting for a decode slot on one instance;
    /// one arriving at a full queue is dropped.
    pub queue_max: usize,
    /// Output length the scheduler assumes for every request when it
    /// predicts decode load, until requests finish decoding; then it uses
    /// the moving mean of the finished ones (it never knows a request's own
    /// output length in advance).
    pub expected_output_tokens: u32,
}

impl Default for DecodeCost {
    fn default() -> Self {
        Self {
            base_ms: 15.0,
            ms_per_seq: 0.05,
            ms_per_1k_context_tokens: 0.0334,
            max_batch: 256,
            max_context_tokens: 1_300_000,
            queue_max: 256,
            expected_output_tokens: 150,
        }
    }
}

/// KV size and the link between the pool and a prefill instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NetworkCost {
    /// Bytes of KV per token (all layers, K and V).
    pub kv_bytes_per_token: u64,
    /// Bandwidth of fetching KV from the pool to a prefill instance, Gbit/s.
    pub link_gbps: f64,
}

impl Default for NetworkCost {
    fn default() -> Self {
        Self {
            kv_bytes_per_token: 327_680,
            link_gbps: 800.0,
        }
    }
}

/// The whole cost model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostModel {
    /// Model name (informational; used in store keys).
    pub model: String,
    /// Tokens per cache block (512 for the Mooncake traces).
    pub block_tokens: u32,
    /// Prefill instances.
    pub prefill: PrefillCost,
    /// Decode instances.
    pub decode: DecodeCost,
    /// KV transfer.
    pub network: NetworkCost,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            model: "llama3-70b-like".to_string(),
            block_tokens: 512,
            prefill: PrefillCost::default(),
            decode: DecodeCost::default(),
            network: NetworkCost::default(),
        }
    }
}

fn non_negative(key: &'static str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(ConfigError::Invalid {
            key,
            reason: format!("must be a finite number >= 0, got {v}"),
        })
    }
}

fn at_least_one(key: &'static str, v: u64) -> Result<(), ConfigError> {
    if v >= 1 {
        Ok(())
    } else {
        Err(ConfigError::Invalid {
            key,
            reason: "must be at least 1".to_string(),
        })
    }
}

impl CostModel {
    /// Parses TOML text; `origin` names the source in errors.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let model: CostModel = toml::from_str(text).map_err(|e| ConfigError::Toml {
            origin: origin.to_string(),
            message: e.to_string(),
        })?;
        model.validate()?;
        Ok(model)
    }

    /// Reads and parses a TOML file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml_str(&text, &path.display().to_string())
    }

    /// Checks every value's range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.model.is_empty() || self.model.contains('@') {
            return Err(ConfigError::Invalid {
                key: "model",
                reason: "must be non-empty and must not contain '@'".into(),
            });
        }
        at_least_one("block_tokens", u64::from(self.block_tokens))?;
        non_negative("prefill.base_ms", self.prefill.base_ms)?;
        non_negative("prefill.ms_per_token", self.prefill.ms_per_token)?;
        non_negative("prefill.ms_per_token_sq", self.prefill.ms_per_token_sq)?;
        at_least_one("prefill.queue_max", self.prefill.queue_max as u64)?;
        non_negative("decode.base_ms", self.decode.base_ms)?;
        non_negative("decode.ms_per_seq", self.decode.ms_per_seq)?;
        non_negative(
            "decode.ms_per_1k_context_tokens",
            self.decode.ms_per_1k_context_tokens,
        )?;
        at_least_one("decode.max_batch", self.decode.max_batch as u64)?;
        at_least_one("decode.max_context_tokens", self.decode.max_context_tokens)?;
        at_least_one("decode.queue_max", self.decode.queue_max as u64)?;
        at_least_one(
            "decode.expected_output_tokens",
            u64::from(self.decode.expected_output_tokens),
        )?;
        at_least_one(
            "network.kv_bytes_per_token",
            self.network.kv_bytes_per_token,
        )?;
        if !(self.network.link_gbps.is_finite() && self.network.link_gbps > 0.0) {
            return Err(ConfigError::Invalid {
                key: "network.link_gbps",
                reason: format!(
                    "must be a finite number > 0, got {}",
                    self.network.link_gbps
                ),
            });
        }
        Ok(())
    }

    /// Prefill time of `uncached` new tokens on top of `cached` reused ones, ms.
    pub fn prefill_ms(&self, uncached: u64, cached: u64) -> f64 {
        let u = uncached as f64;
        let c = cached as f64;
        self.prefill.base_ms
            + self.prefill.ms_per_token * u
            + self.prefill.ms_per_token_sq * u * (u + 2.0 * c)
    }

    /// Time to fetch the KV of `tokens` tokens over the pool link, ms.
    pub fn fetch_ms(&self, tokens: u64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let bits = tokens as f64 * self.network.kv_bytes_per_token as f64 * 8.0;
        bits / (self.network.link_gbps * 1e9) * 1e3
    }

    /// One decode step of `batch` sequences holding `context_tokens` tokens, ms.
    pub fn decode_step_ms(&self, batch: f64, context_tokens: f64) -> f64 {
        self.decode.base_ms
            + self.decode.ms_per_seq * batch
            + self.decode.ms_per_1k_context_tokens * context_tokens / 1000.0
    }

    /// Tokens covered by `blocks` leading blocks of a prompt of `input_tokens`.
    pub fn blocks_to_tokens(&self, blocks: usize, input_tokens: u32) -> u64 {
        (blocks as u64 * u64::from(self.block_tokens)).min(u64::from(input_tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_round_trip_through_toml() {
        let m = CostModel::default();
        m.validate().unwrap();
        let text = toml::to_string(&m).unwrap();
        assert_eq!(CostModel::from_toml_str(&text, "t").unwrap(), m);
        assert_eq!(CostModel::from_toml_str("", "t").unwrap(), m);
    }

    #[test]
    fn formulas() {
        let m = CostModel::default();
        // 15k fresh tokens: about 1.9 s on the default model.
        let fresh = m.prefill_ms(15_000, 0);
        assert!((1800.0..2000.0).contains(&fresh), "{fresh}");
        // Reusing 10k of them leaves 5k new tokens attending over 15k.
        let reused = m.prefill_ms(5_000, 10_000);
        assert!(reused < fresh / 2.0, "{reused}");
        assert!((m.prefill_ms(10, 0) - (30.0 + 0.946 + 2.1e-6 * 100.0)).abs() < 1e-9);
        // 10k tokens of KV (3.28 GB) over 800 Gbps: 32.8 ms.
        assert!((m.fetch_ms(10_000) - 32.768).abs() < 1e-6);
        assert_eq!(m.fetch_ms(0), 0.0);
        assert!((m.decode_step_ms(10.0, 100_000.0) - (15.0 + 0.5 + 3.34)).abs() < 1e-9);
        assert_eq!(m.blocks_to_tokens(3, 1100), 1100);
        assert_eq!(m.blocks_to_tokens(2, 1100), 1024);
    }

    #[test]
    fn unknown_key_and_bad_value_name_the_key() {
        let e = CostModel::from_toml_str("[prefill]\nms_per_tokn = 1.0\n", "t").unwrap_err();
        assert!(e.to_string().contains("ms_per_tokn"), "{e}");
        let e = CostModel::from_toml_str("[decode]\nmax_batch = \"many\"\n", "t").unwrap_err();
        assert!(e.to_string().contains("max_batch"), "{e}");
        let e = CostModel::from_toml_str("[network]\nlink_gbps = 0.0\n", "t").unwrap_err();
        assert!(e.to_string().contains("network.link_gbps"), "{e}");
        let e = CostModel::from_toml_str("[prefill]\nbase_ms = -1.0\n", "t").unwrap_err();
        assert!(e.to_string().contains("prefill.base_ms"), "{e}");
        let e = CostModel::from_toml_str("[prefill]\nlocal_cache_blocks = \"lots\"\n", "t")
            .unwrap_err();
        assert!(e.to_string().contains("local_cache_blocks"), "{e}");
        let m = CostModel::from_toml_str("[prefill]\nlocal_cache_blocks = \"inf\"\n", "t").unwrap();
        assert_eq!(m.prefill.local_cache_blocks, Capacity::Unbounded);
    }
}

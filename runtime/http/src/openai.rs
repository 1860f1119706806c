//! The serving contract: the parts of the OpenAI-compatible bodies that
//! kvpool's conductor front, its proxies and its engine exchange, typed once
//! here and used by all three. kvpool's additions ride in fields vLLM does
//! not know (a `kvpool` object, extra `kv_transfer_params` fields), which
//! vLLM ignores; fields of another engine's `kv_transfer_params` (vLLM's KV
//! connectors) pass through the front untouched.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// vLLM's `kv_transfer_params`, with kvpool's fields. A prefill asked with
/// `do_remote_decode` answers the params its decode is sent with
/// `do_remote_prefill`.
/// The request field that carries the prompt's token ids from the front
/// to the prefill and decode engines (the front tokenized the prompt once);
/// an engine that has them does not tokenize `prompt` or `messages` again.
/// vLLM ignores it.
pub const PROMPT_TOKEN_IDS: &str = "kvpool_prompt_token_ids";

/// The request field with which the front continues a stream on another
/// decode engine: how many of the prompt's last tokens were generated and
/// how much of their text the client already has. The front's own; a
/// client's field of that name is not passed on.
pub const RESUME: &str = "kvpool_resume";

/// The request field with which the front tells the prefill engine how
/// many leading chunks of the prompt it found in the pool (its one lookup,
/// the one it routed by): the engine reads that many chunks without a
/// lookup of its own. A hint, not a promise: every chunk read is checked,
/// and the run ends at the first one missing. The front's own; a client's
/// field of that name is not passed on. vLLM ignores it.
pub const POOL_PREFIX: &str = "kvpool_pool_prefix";

#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct KvTransferParams {
    pub do_remote_decode: bool,
    pub do_remote_prefill: bool,
    /// Pool keys of the prompt's leading chunks, in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub chunk_keys: Vec<String>,
    /// Prompt tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_tokens: Option<usize>,
    /// Tokens per chunk of the keys.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chunk_tokens: Option<usize>,
    /// The pool's master address.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Fields kvpool does not read (another engine's KV connector's), kept.
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// The `kvpool` object of a completion answer: where its prompt's KV came
/// from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct PromptKv {
    /// Prompt tokens this engine computed.
    pub prompt_tokens_computed: u64,
    /// Prompt tokens whose KV it loaded from the pool.
    pub prompt_tokens_loaded: u64,
    /// Chunks it found in the pool but could not use (failed checks).
    pub chunks_refused: u64,
}

/// How an engine names its KV chunks in the pool (the `kvpool` object of a
/// model in its `/v1/models`): `key_model@hash@key_format@chunk_tokens`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvNaming {
    /// Tokens per chunk.
    pub chunk_tokens: usize,
    /// The model part of the key.
    pub key_model: String,
    /// The layout part of the key.
    pub key_format: String,
    /// The pool's master the engine uses, if any.
    pub pool: Option<String>,
}

/// One model of `/v1/models`: OpenAI's fields, vLLM's `max_model_len`, and
/// our engine's `kvpool` naming.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Model {
    pub id: String,
    #[serde(default)]
    pub object: String,
    #[serde(default)]
    pub created: u64,
    #[serde(default)]
    pub owned_by: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<String>,
    #[serde(default)]
    pub parent: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvpool: Option<KvNaming>,
}

impl Model {
    /// A model named `id` made at `created` (Unix seconds), owned by kvpool.
    pub fn new(id: impl Into<String>, created: u64) -> Self {
        Self {
            id: id.into(),
            object: "model".into(),
            created,
            owned_by: "kvpool".into(),
            root: None,
            parent: None,
            max_model_len: None,
            kvpool: None,
        }
    }
}

/// The answer of `/v1/models`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelList {
    #[serde(default)]
    pub object: String,
    pub data: Vec<Model>,
}

impl ModelList {
    pub fn new(data: Vec<Model>) -> Self {
        Self {
            object: "list".into(),
            data,
        }
    }
}

/// What the front reads of a prefill engine's (non-streamed) answer: ours,
/// or vLLM's (no `kvpool` object).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct PrefillAnswer {
    pub id: Option<String>,
    pub model: Option<String>,
    pub usage: Option<Usage>,
    pub kvpool: Option<PromptKv>,
    pub kv_transfer_params: Option<KvTransferParams>,
}

/// An answer's `usage`, as far as the front reads it.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Usage {
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

/// `usage.prompt_tokens_details`: prompt tokens served from a cache.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct PromptTokensDetails {
    pub cached_tokens: Option<u64>,
}

impl PrefillAnswer {
    /// Prompt tokens the engine did not compute (0 when it does not say).
    pub fn cached_tokens(&self) -> u64 {
        self.usage
            .as_ref()
            .and_then(|u| u.prompt_tokens_details.as_ref())
            .and_then(|d| d.cached_tokens)
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_vllm_connectors_fields_pass_through_and_kvpools_optional_ones_stay_out() {
        let v = json!({"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": "e1", "remote_block_ids": [1, 2]});
        let mut p: KvTransferParams = serde_json::from_value(v).unwrap();
        assert_eq!(p.other.len(), 2);
        (p.do_remote_decode, p.do_remote_prefill) = (false, true);
        assert_eq!(
            serde_json::to_value(&p).unwrap(),
            json!({"do_remote_decode": false, "do_remote_prefill": true,
                "remote_engine_id": "e1", "remote_block_ids": [1, 2]})
        );
    }

    #[test]
    fn a_prefill_answer_of_vllm_or_ours_is_read_and_a_wrong_shape_is_an_error() {
        let ours = json!({"id": "cmpl-1", "model": "m", "usage": {"prompt_tokens": 9,
            "prompt_tokens_details": {"cached_tokens": 4}},
            "kvpool": {"prompt_tokens_computed": 5, "prompt_tokens_loaded": 4, "chunks_refused": 0},
            "kv_transfer_params": {"do_remote_decode": false, "do_remote_prefill": true,
                "chunk_keys": ["k0"], "num_tokens": 9, "chunk_tokens": 4, "pool": null}});
        let a: PrefillAnswer = serde_json::from_value(ours).unwrap();
        assert_eq!(a.cached_tokens(), 4);
        assert_eq!(a.kvpool.unwrap().prompt_tokens_computed, 5);
        assert_eq!(a.kv_transfer_params.unwrap().chunk_keys, ["k0"]);
        let vllm = json!({"id": "cmpl-2", "usage": {"prompt_tokens_details": null},
            "kv_transfer_params": null});
        let a: PrefillAnswer = serde_json::from_value(vllm).unwrap();
        assert_eq!(
            (a.cached_tokens(), a.kvpool, a.kv_transfer_params),
            (0, None, None)
        );
        assert!(serde_json::from_value::<PrefillAnswer>(json!({"id": 7})).is_err());
    }
}

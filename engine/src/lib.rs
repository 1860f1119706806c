//! kvpool's inference engine: a Llama-family decoder on the CPU (candle)
//! whose KV cache is exported to and imported from the kvpool pool by chunk.
//!
//! * [`model_config`], [`loader`], [`tokenizer`]: what a model folder (or a
//!   built-in seeded model) holds, loaded and checked at start-up.
//! * [`model`]: the decoder's forward pass over any mix of sequences.
//! * [`kv`]: a sequence's KV as blocks that are byte for byte the pool's
//!   chunk objects (header, checksum, layout).
//! * [`pool`]: importing a prompt's cached chunks, storing new ones.
//! * [`scheduler`]: the model thread: admission, chunked prefill, batched
//!   decode, sampling ([`sampling`]).
//! * [`serve`]: `kvpool run --role engine`, vLLM's HTTP API subset
//!   ([`logprobs`]: OpenAI's logprobs fields and answers).

pub mod error;
pub mod kv;
pub mod loader;
pub mod logprobs;
pub mod metrics;
pub mod model;
pub mod model_config;
pub mod pool;
pub mod sampling;
pub mod scheduler;
pub mod serve;
pub mod tokenizer;

pub use error::EngineError;

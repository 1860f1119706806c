//! Text <-> token ids: a Hugging Face `tokenizer.json`, or the byte-level
//! tokenizer of the built-in models (one token per byte, then BOS and EOS).

use std::path::Path;

use crate::error::EngineError;

/// Vocabulary of the byte-level tokenizer: 256 bytes, BOS, EOS.
pub const BYTE_VOCAB: usize = 258;
/// Beginning-of-sequence token of the byte-level tokenizer.
pub const BYTE_BOS: u32 = 256;
/// End-of-sequence token of the byte-level tokenizer.
pub const BYTE_EOS: u32 = 257;

/// A tokenizer the engine can use.
pub enum Tokenizer {
    /// One token per byte; BOS is prepended on encode, specials are dropped
    /// on decode.
    Bytes,
    /// A Hugging Face tokenizer (`tokenizer.json`).
    Hf(Box<tokenizers::Tokenizer>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tokenizer::Bytes => f.write_str("Tokenizer::Bytes"),
            Tokenizer::Hf(_) => f.write_str("Tokenizer::Hf"),
        }
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json`.
    pub fn from_file(file: &Path) -> Result<Self, EngineError> {
        let t = tokenizers::Tokenizer::from_file(file).map_err(|e| {
            EngineError::model(file, "(file)", format!("not a usable tokenizer: {e}"))
        })?;
        Ok(Tokenizer::Hf(Box::new(t)))
    }

    /// Token ids of `text`, with the tokenizer's special tokens (BOS).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        match self {
            Tokenizer::Bytes => {
                let mut v = Vec::with_capacity(text.len() + 1);
                v.push(BYTE_BOS);
                v.extend(text.bytes().map(u32::from));
                Ok(v)
            }
            Tokenizer::Hf(t) => t
                .encode(text, true)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| EngineError::BadRequest(format!("cannot tokenize the prompt: {e}"))),
        }
    }

    /// The bytes `ids` stand for, special tokens left out. Byte-level
    /// tokens may end inside a UTF-8 character: callers decode the whole
    /// generated sequence and hold back an incomplete tail.
    pub fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        match self {
            Tokenizer::Bytes => ids.iter().filter(|&&t| t < 256).map(|&t| t as u8).collect(),
            Tokenizer::Hf(t) => t.decode(ids, true).unwrap_or_default().into_bytes(),
        }
    }
}

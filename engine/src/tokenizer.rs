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

/// The names of the byte-level tokenizer's BOS and EOS in its Hugging Face
/// form.
pub const BYTE_BOS_TEXT: &str = "<s>";
pub const BYTE_EOS_TEXT: &str = "</s>";

/// The character GPT-2's byte-level scheme gives each byte (printable
/// Latin-1 bytes stand for themselves, the rest are moved past U+00FF),
/// the alphabet Hugging Face's `ByteLevel` pre-tokenizer and decoder use.
fn byte_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    let mut next = 256u32;
    for b in 0..256u32 {
        let c = if printable(b) {
            b
        } else {
            next += 1;
            next - 1
        };
        out[b as usize] = char::from_u32(c).expect("below U+0200");
    }
    out
}

impl Tokenizer {
    /// This tokenizer as a Hugging Face `tokenizer.json` (issue 30), so a
    /// client (a load generator, `transformers`) counts tokens as the engine
    /// does. The byte-level tokenizer becomes a byte-level BPE without
    /// merges: each byte one token with the byte's value, `<s>` (256)
    /// prepended, `</s>` 257. One difference: a prompt holding the literal
    /// text `<s>` or `</s>` is one special token there, bytes here.
    pub fn to_hf_json(&self) -> Result<String, EngineError> {
        let written = match self {
            Tokenizer::Hf(t) => t.to_string(false),
            Tokenizer::Bytes => byte_level_hf()?.to_string(true),
        };
        written.map_err(|e| EngineError::BadRequest(format!("tokenizer.json: {e}")))
    }
}

fn byte_level_hf() -> Result<tokenizers::Tokenizer, EngineError> {
    use tokenizers::models::bpe::{Vocab, BPE};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::processors::template::TemplateProcessing;
    use tokenizers::AddedToken;
    let err = |e: tokenizers::Error| EngineError::BadRequest(format!("tokenizer.json: {e}"));
    let vocab: Vocab = byte_chars()
        .iter()
        .enumerate()
        .map(|(b, c)| (c.to_string(), b as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, Vec::new())
        .build()
        .map_err(err)?;
    let mut t = tokenizers::Tokenizer::new(bpe);
    t.with_pre_tokenizer(Some(ByteLevel::new(false, false, false)));
    t.with_decoder(Some(ByteLevel::new(false, false, false)));
    t.add_special_tokens([
        AddedToken::from(BYTE_BOS_TEXT, true),
        AddedToken::from(BYTE_EOS_TEXT, true),
    ])
    .map_err(err)?;
    let template = TemplateProcessing::builder()
        .try_single(format!("{BYTE_BOS_TEXT} $A"))
        .map_err(|e| EngineError::BadRequest(format!("tokenizer.json: {e}")))?
        .special_tokens(vec![(BYTE_BOS_TEXT, BYTE_BOS)])
        .build()
        .map_err(|e| EngineError::BadRequest(format!("tokenizer.json: {e}")))?;
    t.with_post_processor(Some(template));
    Ok(t)
}

/// The `tokenizer_config.json` beside [`Tokenizer::to_hf_json`]'s file, so
/// `transformers.AutoTokenizer.from_pretrained(folder)` loads it: the fast
/// tokenizer class, the context length, and the byte-level tokenizer's BOS
/// and EOS (a model folder's own special tokens are in its tokenizer.json).
pub fn hf_tokenizer_config(tok: &Tokenizer, max_model_len: usize) -> String {
    let mut v = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_model_len,
        "clean_up_tokenization_spaces": false,
    });
    if matches!(tok, Tokenizer::Bytes) {
        v["bos_token"] = BYTE_BOS_TEXT.into();
        v["eos_token"] = BYTE_EOS_TEXT.into();
    }
    serde_json::to_string_pretty(&v).expect("a JSON value")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_tokenizer_as_tokenizer_json_counts_and_decodes_as_the_engine_does() {
        let json = Tokenizer::Bytes.to_hf_json().unwrap();
        let hf: tokenizers::Tokenizer = json.parse().unwrap();
        let all_bytes: Vec<u8> = (0..=255u8).collect();
        let every_byte = String::from_utf8_lossy(&all_bytes).into_owned();
        for text in [
            "",
            "hello world",
            "  two  spaces\tand a tab\nand a newline",
            "héllo wörld, 你好, emoji 🦀",
            &every_byte,
        ] {
            let want = Tokenizer::Bytes.encode(text).unwrap();
            let got = hf.encode(text, true).unwrap().get_ids().to_vec();
            assert_eq!(got, want, "{text:?}");
            let back = hf.decode(&got, true).unwrap();
            assert_eq!(
                back.as_bytes(),
                Tokenizer::Bytes.decode_bytes(&want),
                "{text:?}"
            );
        }
        assert_eq!(hf.token_to_id(BYTE_EOS_TEXT), Some(BYTE_EOS));
        assert_eq!(hf.get_vocab_size(true), BYTE_VOCAB);
    }
}

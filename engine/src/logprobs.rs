//! OpenAI's `logprobs` in requests and answers.
//!
//! A completion asks with `logprobs: N` (N alternatives per token, 0 to
//! [`MAX_TOP_LOGPROBS`]) and gets `{tokens, token_logprobs, top_logprobs,
//! text_offset}`; a chat asks with `logprobs: true` and `top_logprobs: N`
//! and gets `{content: [{token, logprob, bytes, top_logprobs}]}`. A token's
//! string is its bytes when they are UTF-8, else `bytes:\xe2\x82` (OpenAI's
//! own form for a token that holds part of a character, so no two tokens
//! share a string); `bytes` in the chat form has them exactly.
//! `text_offset` is the number of characters of the answer's text before
//! the token (a character cut at that point counted as one U+FFFD),
//! counted from the answer's start, a continued answer's included.

use serde_json::{json, Map, Value};

use crate::sampling::{TokenLogprobs, MAX_TOP_LOGPROBS};
use crate::tokenizer::Tokenizer;

/// Why a request's logprobs fields are refused.
pub type Refusal = String;

/// How many alternatives per token a request asks for (`None`: no
/// logprobs). `top_logprobs` is the chat field; a completion names the
/// count in `logprobs`.
pub fn asked(
    logprobs: Option<&Value>,
    top_logprobs: Option<&Value>,
    chat: bool,
) -> Result<Option<usize>, Refusal> {
    let logprobs = logprobs.filter(|v| !v.is_null());
    let top = top_logprobs.filter(|v| !v.is_null());
    let count = |v: &Value, name: &str| -> Result<usize, Refusal> {
        v.as_u64()
            .filter(|&k| k <= MAX_TOP_LOGPROBS as u64)
            .map(|k| k as usize)
            .ok_or_else(|| format!("`{name}` must be an integer from 0 to {MAX_TOP_LOGPROBS}"))
    };
    if chat {
        let on = match logprobs {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err("`logprobs` of a chat request is true or false".into()),
        };
        match (on, top) {
            (false, Some(v)) if v.as_u64() != Some(0) => {
                Err("`top_logprobs` needs `logprobs: true`".into())
            }
            (false, _) => Ok(None),
            (true, None) => Ok(Some(0)),
            (true, Some(v)) => count(v, "top_logprobs").map(Some),
        }
    } else {
        if top.is_some_and(|v| v.as_u64() != Some(0)) {
            return Err(
                "`top_logprobs` is a chat field: a completion asks with `logprobs: N`".into(),
            );
        }
        match logprobs {
            None | Some(Value::Bool(false)) => Ok(None),
            Some(v) => count(v, "logprobs").map(Some),
        }
    }
}

/// A token's string and bytes.
fn token(tok: &Tokenizer, t: u32) -> (String, Vec<u8>) {
    let b = tok.decode_bytes(&[t]);
    let s = match std::str::from_utf8(&b) {
        Ok(s) => s.to_string(),
        Err(_) => {
            let mut s = String::from("bytes:");
            for x in &b {
                s.push_str(&format!("\\x{x:02x}"));
            }
            s
        }
    };
    (s, b)
}

/// Builds the `logprobs` of an answer, token by token.
pub struct Builder {
    chat: bool,
    /// Characters of the answer's text up to its last character that can
    /// no longer change, and the bytes after it (an incomplete UTF-8
    /// sequence): `text_offset` without decoding the whole answer per token.
    chars: usize,
    tail: Vec<u8>,
    tokens: Vec<Value>,
    token_logprobs: Vec<Value>,
    top: Vec<Value>,
    offsets: Vec<Value>,
}

impl Builder {
    pub fn new(chat: bool) -> Self {
        Self {
            chat,
            chars: 0,
            tail: Vec::new(),
            tokens: Vec::new(),
            token_logprobs: Vec::new(),
            top: Vec::new(),
            offsets: Vec::new(),
        }
    }

    /// Starts after `tokens` another engine generated (a continued answer:
    /// offsets count from the answer's start).
    pub fn resume(&mut self, tok: &Tokenizer, tokens: &[u32]) {
        self.chars = 0;
        self.tail.clear();
        self.add_bytes(&tok.decode_bytes(tokens));
    }

    /// Counts `bytes` into the text: what is settled (valid characters, and
    /// invalid sequences, one U+FFFD each) into `chars`; an incomplete tail
    /// waits in `tail` for the bytes that may complete it.
    fn add_bytes(&mut self, bytes: &[u8]) {
        self.tail.extend_from_slice(bytes);
        let mut rest = &self.tail[..];
        loop {
            match std::str::from_utf8(rest) {
                Ok(v) => {
                    self.chars += v.chars().count();
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // `valid` is UTF-8 by the error's own account.
                    self.chars += String::from_utf8_lossy(valid).chars().count();
                    match e.error_len() {
                        Some(n) => {
                            self.chars += 1;
                            rest = &after[n..];
                        }
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let from = self.tail.len() - keep;
        self.tail.drain(..from);
    }

    /// Adds sampled token `t`.
    pub fn push(&mut self, tok: &Tokenizer, t: u32, lp: &TokenLogprobs) {
        let (s, bytes) = token(tok, t);
        let offset =
            (!self.chat).then(|| self.chars + String::from_utf8_lossy(&self.tail).chars().count());
        self.add_bytes(&bytes);
        if self.chat {
            let top: Vec<Value> = lp
                .top
                .iter()
                .map(|&(a, l)| {
                    let (s, b) = token(tok, a);
                    json!({"token": s, "logprob": l, "bytes": b})
                })
                .collect();
            self.tokens.push(
                json!({"token": s, "logprob": lp.logprob, "bytes": bytes, "top_logprobs": top}),
            );
        } else {
            // vLLM's form: the alternatives and the sampled token.
            let mut top = Map::new();
            for &(a, l) in &lp.top {
                top.entry(token(tok, a).0).or_insert(json!(l));
            }
            top.entry(s.clone()).or_insert(json!(lp.logprob));
            self.offsets.push(json!(offset));
            self.tokens.push(json!(s));
            self.token_logprobs.push(json!(lp.logprob));
            self.top.push(Value::Object(top));
        }
    }

    /// The `logprobs` value of the tokens pushed since the last take.
    pub fn take(&mut self) -> Value {
        let tokens = std::mem::take(&mut self.tokens);
        if self.chat {
            json!({"content": tokens})
        } else {
            json!({"tokens": tokens,
                "token_logprobs": std::mem::take(&mut self.token_logprobs),
                "top_logprobs": std::mem::take(&mut self.top),
                "text_offset": std::mem::take(&mut self.offsets)})
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_fields_ask_as_openai_says_and_bad_ones_are_named() {
        let a = |lp: Value, top: Value, chat| asked(Some(&lp), Some(&top), chat);
        assert_eq!(a(json!(3), json!(null), false), Ok(Some(3)));
        assert_eq!(a(json!(null), json!(null), false), Ok(None));
        assert_eq!(a(json!(false), json!(0), false), Ok(None));
        assert!(a(json!(21), json!(null), false)
            .unwrap_err()
            .contains("0 to 20"));
        assert!(a(json!(true), json!(null), false).is_err());
        assert!(a(json!(null), json!(2), false)
            .unwrap_err()
            .contains("chat field"));
        assert_eq!(a(json!(true), json!(null), true), Ok(Some(0)));
        assert_eq!(a(json!(true), json!(5), true), Ok(Some(5)));
        assert_eq!(a(json!(false), json!(null), true), Ok(None));
        assert!(a(json!(false), json!(5), true)
            .unwrap_err()
            .contains("logprobs: true"));
        assert!(a(json!(3), json!(null), true).is_err());
    }

    #[test]
    fn answers_carry_each_tokens_logprob_and_alternatives() {
        let tok = Tokenizer::Bytes;
        let lp = |l, top: &[(u32, f32)]| TokenLogprobs {
            logprob: l,
            top: top.to_vec(),
        };
        let mut b = Builder::new(false);
        b.push(
            &tok,
            u32::from(b'h'),
            &lp(-0.5, &[(u32::from(b'a'), -0.25)]),
        );
        b.push(&tok, 0xe2, &lp(-1.0, &[(0xe3, -2.0)]));
        b.push(&tok, 0x82, &lp(-1.0, &[]));
        b.push(&tok, 0xac, &lp(-1.0, &[]));
        b.push(&tok, u32::from(b'!'), &lp(-1.0, &[]));
        let v = b.take();
        assert_eq!(v["tokens"][0], "h");
        assert_eq!(v["tokens"][1], "bytes:\\xe2");
        assert_eq!(v["token_logprobs"][0], -0.5);
        assert_eq!(v["top_logprobs"][0], json!({"a": -0.25, "h": -0.5}));
        // Parts of one character are told apart.
        assert_eq!(
            v["top_logprobs"][1],
            json!({"bytes:\\xe3": -2.0, "bytes:\\xe2": -1.0})
        );
        // "h" then the euro sign's three bytes, then "!": offsets in the text.
        assert_eq!(v["text_offset"], json!([0, 1, 2, 2, 2]));
        assert_eq!(b.take()["tokens"], json!([]));
        // A continued answer counts from the answer's start.
        let mut b = Builder::new(false);
        b.resume(&tok, &[u32::from(b'a'), u32::from(b'b')]);
        b.push(&tok, u32::from(b'c'), &lp(-1.0, &[]));
        assert_eq!(b.take()["text_offset"], json!([2]));
        let mut b = Builder::new(true);
        b.push(&tok, 0xe2, &lp(-1.0, &[(u32::from(b'x'), -0.125)]));
        let c = &b.take()["content"][0];
        assert_eq!(c["bytes"], json!([0xe2]));
        assert_eq!(c["top_logprobs"][0]["token"], "x");
    }
}

//! Mooncake-format request traces.
//!
//! One JSON object per line: `timestamp` (ms from the start of the trace),
//! `input_length` and `output_length` (tokens) and `hash_ids`, one
//! prefix-chained block id per `block_tokens` (512) tokens of the prompt, the
//! last block possibly partial. Extra fields are ignored, so traces that carry
//! more columns still load. Blank lines are skipped.
//!
//! The first non-blank line may instead be the header that `kvpool sim gen`
//! writes: an object `{"kvpool_trace_gen": VERSION, "params": {...}}` holding
//! the generator's parameters ([`GenParams`]). It is checked strictly (the
//! version must be this build's, the parameters complete and in range), kept
//! ([`Trace::generator`]) and not read as a request. Such a line anywhere
//! else is an error.
//!
//! Every request is checked on load: `hash_ids` must have exactly
//! `ceil(input_length / block_tokens)` entries, and timestamps must not go
//! backwards. A line that fails to parse or fails a check is an error that
//! names the line (1-based).

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::gen::{GenParams, GEN_VERSION, HEADER_KEY};
use kvpool_conductor::chunk_hash::{ChunkHash, MOONCAKE_CHUNK_TOKENS};

/// Errors of trace loading.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("cannot read trace {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A line is not a valid trace record.
    #[error("trace {origin}, line {line}: {source}")]
    Parse {
        origin: String,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    /// A line parsed but breaks an invariant of the format.
    #[error("trace {origin}, line {line}: {reason}")]
    Invalid {
        origin: String,
        line: usize,
        reason: String,
    },
    /// The trace holds no request.
    #[error("trace {origin} holds no request")]
    Empty { origin: String },
}

#[derive(Deserialize)]
struct RawRecord {
    timestamp: u64,
    input_length: u32,
    output_length: u32,
    hash_ids: Vec<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHeader {
    kvpool_trace_gen: u32,
    params: GenParams,
}

/// Whether `text` is a JSON object with the generator header's key.
fn is_header(text: &str) -> bool {
    serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(text)
        .is_ok_and(|m| m.contains_key(HEADER_KEY))
}

/// One request of a trace. Its blocks are in the owning [`Trace`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceRequest {
    /// 1-based line number in the source.
    pub line: usize,
    /// Arrival time, ms from the start of the trace (as written, not rebased).
    pub timestamp_ms: u64,
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Generated tokens (the first one comes out of prefill).
    pub output_tokens: u32,
    blocks: Range<u32>,
}

/// A loaded trace: requests in arrival order, with their block ids stored
/// contiguously.
#[derive(Debug, Clone)]
pub struct Trace {
    requests: Vec<TraceRequest>,
    blocks: Vec<ChunkHash>,
    block_tokens: u32,
    generator: Option<GenParams>,
}

impl Trace {
    /// Loads a trace file whose blocks hold 512 tokens (the Mooncake traces).
    pub fn load(path: &Path) -> Result<Self, TraceError> {
        Self::load_with_block_tokens(path, MOONCAKE_CHUNK_TOKENS as u32)
    }

    /// Loads a trace file whose blocks hold `block_tokens` tokens.
    pub fn load_with_block_tokens(path: &Path, block_tokens: u32) -> Result<Self, TraceError> {
        let file = File::open(path).map_err(|source| TraceError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(
            BufReader::new(file),
            &path.display().to_string(),
            block_tokens,
        )
    }

    /// Parses a trace from a reader. `origin` names the source in errors.
    pub fn parse<R: BufRead>(
        mut reader: R,
        origin: &str,
        block_tokens: u32,
    ) -> Result<Self, TraceError> {
        if block_tokens == 0 {
            return Err(TraceError::Invalid {
                origin: origin.to_string(),
                line: 0,
                reason: "block size must be at least one token".into(),
            });
        }
        let mut requests = Vec::new();
        let mut blocks: Vec<ChunkHash> = Vec::new();
        let mut line_buf = String::new();
        let mut line_no = 0usize;
        let mut last_ts = 0u64;
        let mut generator = None;
        let mut first = true;
        loop {
            line_buf.clear();
            let n = reader
                .read_line(&mut line_buf)
                .map_err(|source| TraceError::Io {
                    path: PathBuf::from(origin),
                    source,
                })?;
            if n == 0 {
                break;
            }
            line_no += 1;
            let text = line_buf.trim();
            if text.is_empty() {
                continue;
            }
            let invalid = |reason: String| TraceError::Invalid {
                origin: origin.to_string(),
                line: line_no,
                reason,
            };
            let is_first = std::mem::replace(&mut first, false);
            let parse_err = |source| TraceError::Parse {
                origin: origin.to_string(),
                line: line_no,
                source,
            };
            if is_first && is_header(text) {
                let h: RawHeader = serde_json::from_str(text).map_err(parse_err)?;
                if h.kvpool_trace_gen != GEN_VERSION {
                    return Err(invalid(format!(
                        "generator header version {} is not supported (this build reads version {GEN_VERSION})",
                        h.kvpool_trace_gen
                    )));
                }
                h.params
                    .validate()
                    .map_err(|e| invalid(format!("generator header: {e}")))?;
                generator = Some(h.params);
                continue;
            }
            let rec: RawRecord = match serde_json::from_str(text) {
                Ok(rec) => rec,
                Err(_) if is_header(text) => {
                    return Err(invalid(
                        "a generator header is only allowed on the first line".into(),
                    ))
                }
                Err(source) => return Err(parse_err(source)),
            };
            let want = rec.input_length.div_ceil(block_tokens) as usize;
            if rec.hash_ids.len() != want {
                return Err(invalid(format!(
                    "hash_ids has {} entries but input_length {} needs ceil({}/{}) = {}",
                    rec.hash_ids.len(),
                    rec.input_length,
                    rec.input_length,
                    block_tokens,
                    want
                )));
            }
            if rec.timestamp < last_ts {
                return Err(invalid(format!(
                    "timestamp {} is earlier than the previous request's {} (traces must be in arrival order)",
                    rec.timestamp, last_ts
                )));
            }
            last_ts = rec.timestamp;
            let start = blocks.len();
            blocks.extend(rec.hash_ids.iter().map(|&id| ChunkHash(id)));
            let end = blocks.len();
            if end > u32::MAX as usize {
                return Err(invalid("trace holds more than 2^32 blocks".into()));
            }
            requests.push(TraceRequest {
                line: line_no,
                timestamp_ms: rec.timestamp,
                input_tokens: rec.input_length,
                output_tokens: rec.output_length,
                blocks: start as u32..end as u32,
            });
        }
        if requests.is_empty() {
            return Err(TraceError::Empty {
                origin: origin.to_string(),
            });
        }
        Ok(Self {
            requests,
            blocks,
            block_tokens,
            generator,
        })
    }

    /// Requests in arrival order.
    pub fn requests(&self) -> &[TraceRequest] {
        &self.requests
    }

    /// Block ids of one request of this trace, in prefix order.
    pub fn blocks(&self, req: &TraceRequest) -> &[ChunkHash] {
        &self.blocks[req.blocks.start as usize..req.blocks.end as usize]
    }

    /// Requests with their blocks.
    pub fn iter(&self) -> impl Iterator<Item = (&TraceRequest, &[ChunkHash])> + '_ {
        self.requests.iter().map(move |r| (r, self.blocks(r)))
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// Whether the trace holds no request (never true for a loaded trace).
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// The parameters of `kvpool sim gen` if the trace starts with its
    /// header.
    pub fn generator(&self) -> Option<&GenParams> {
        self.generator.as_ref()
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens
    }

    /// Sum of all requests' block counts.
    pub fn total_blocks(&self) -> u64 {
        self.blocks.len() as u64
    }

    /// Time from the first to the last arrival, ms.
    pub fn span_ms(&self) -> u64 {
        match (self.requests.first(), self.requests.last()) {
            (Some(a), Some(b)) => b.timestamp_ms - a.timestamp_ms,
            _ => 0,
        }
    }

    /// Writes a smaller copy of `p.requests` requests from the `p.skip`th
    /// (see [`ScaleParams`]) in the same format; returns the requests
    /// written.
    pub fn write_scaled<W: Write>(&self, p: &ScaleParams, out: &mut W) -> std::io::Result<u64> {
        let mut n = 0;
        for (r, blocks) in self.iter().skip(p.skip).take(p.requests) {
            let (input, output) = p.scale(self.block_tokens, r, blocks.len());
            let ids: Vec<u64> = blocks.iter().map(|b| b.0).collect();
            let line = serde_json::json!({"timestamp": r.timestamp_ms, "input_length": input,
                "output_length": output, "hash_ids": ids});
            writeln!(out, "{line}")?;
            n += 1;
        }
        Ok(n)
    }
}

/// How [`Trace::write_scaled`] shrinks a trace: every block keeps its id and
/// becomes `block_tokens` tokens (so prefixes are shared exactly as in the
/// source), the last, partial block shrinks in proportion (at least one
/// token); outputs are multiplied by `output_scale` and clamped to
/// `1..=output_max`; timestamps are kept (replay speed is the reader's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScaleParams {
    /// Tokens per block in the written trace.
    pub block_tokens: u32,
    /// Requests passed over at the start.
    pub skip: usize,
    /// Requests kept after those.
    pub requests: usize,
    /// Factor on output lengths.
    pub output_scale: f64,
    /// Longest output written.
    pub output_max: u32,
}

impl ScaleParams {
    /// Checks the parameters; the message names the flag.
    pub fn validate(&self) -> Result<(), String> {
        if self.block_tokens == 0 {
            return Err("--block-tokens must be at least 1".into());
        }
        if self.requests == 0 {
            return Err("--requests must be at least 1".into());
        }
        if !(self.output_scale.is_finite() && self.output_scale > 0.0) {
            return Err(format!(
                "--output-scale must be a finite number > 0, got {}",
                self.output_scale
            ));
        }
        if self.output_max == 0 {
            return Err("--output-max must be at least 1".into());
        }
        Ok(())
    }

    /// (input, output) tokens of `r`, whose prompt has `blocks` blocks of
    /// `from_block_tokens`, in the scaled trace.
    fn scale(&self, from_block_tokens: u32, r: &TraceRequest, blocks: usize) -> (u64, u32) {
        let full = blocks.saturating_sub(1) as u64;
        let last = u64::from(r.input_tokens) - full * u64::from(from_block_tokens);
        let last = (last * u64::from(self.block_tokens))
            .div_ceil(u64::from(from_block_tokens))
            .max(1);
        let input = full * u64::from(self.block_tokens) + last;
        let output = (f64::from(r.output_tokens) * self.output_scale).round();
        let output = (output as u32).clamp(1, self.output_max);
        (input, output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Trace, TraceError> {
        Trace::parse(s.as_bytes(), "test", 512)
    }

    #[test]
    fn parses_records_and_skips_blank_lines() {
        let t = parse(
            "{\"timestamp\": 0, \"input_length\": 513, \"output_length\": 3, \"hash_ids\": [1, 2]}\n\n\
             {\"timestamp\": 5, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1], \"extra\": true}\n",
        )
        .unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t.requests()[1].line, 3);
        assert_eq!(t.blocks(&t.requests()[0]), &[ChunkHash(1), ChunkHash(2)]);
        assert_eq!(t.total_blocks(), 3);
        assert_eq!(t.span_ms(), 5);
    }

    #[test]
    fn a_scaled_trace_keeps_the_blocks_and_reads_back_at_its_block_size() {
        let t = parse(
            "{\"timestamp\": 0, \"input_length\": 1100, \"output_length\": 300, \"hash_ids\": [1, 2, 3]}\n\
             {\"timestamp\": 7, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [1]}\n\
             {\"timestamp\": 9, \"input_length\": 5, \"output_length\": 2, \"hash_ids\": [4]}\n",
        )
        .unwrap();
        let p = ScaleParams {
            block_tokens: 16,
            skip: 0,
            requests: 2,
            output_scale: 0.25,
            output_max: 64,
        };
        p.validate().unwrap();
        let mut out = Vec::new();
        assert_eq!(t.write_scaled(&p, &mut out).unwrap(), 2);
        let s = Trace::parse(&out[..], "scaled", 16).unwrap();
        assert_eq!(s.len(), 2);
        // 2 full blocks of 16, then 76 of 512 -> ceil(76 * 16 / 512) = 3.
        assert_eq!(s.requests()[0].input_tokens, 35);
        assert_eq!(s.requests()[0].output_tokens, 64);
        assert_eq!(s.requests()[0].timestamp_ms, 0);
        assert_eq!(s.requests()[1].input_tokens, 16);
        assert_eq!(s.requests()[1].output_tokens, 1);
        assert_eq!(s.blocks(&s.requests()[0]), t.blocks(&t.requests()[0]));
        let mut tail = Vec::new();
        let skip = ScaleParams { skip: 2, ..p };
        assert_eq!(t.write_scaled(&skip, &mut tail).unwrap(), 1);
        let s = Trace::parse(&tail[..], "tail", 16).unwrap();
        assert_eq!(s.requests()[0].timestamp_ms, 9);
        assert!(ScaleParams {
            block_tokens: 0,
            ..p
        }
        .validate()
        .is_err());
        assert!(ScaleParams {
            output_scale: f64::NAN,
            ..p
        }
        .validate()
        .is_err());
    }

    #[test]
    fn bad_lines_name_their_line_number() {
        let err = parse(
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\nnot json\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");
        let err = parse(
            "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 1, \"hash_ids\": [1]}\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("line 1"), "{err}");
        assert!(err.to_string().contains("hash_ids has 1 entries"), "{err}");
        let err = parse(
            "{\"timestamp\": 9, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n\
             {\"timestamp\": 3, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");
        let err = parse("{\"timestamp\": 0, \"input_length\": 1}\n").unwrap_err();
        assert!(err.to_string().contains("line 1"), "{err}");
        assert!(matches!(parse("\n\n"), Err(TraceError::Empty { .. })));
    }

    #[test]
    fn generator_header_only_on_the_first_line_and_checked() {
        use crate::gen::{header_line, Preset};
        let p = Preset::Bursty.params(3, 10);
        let req =
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n";
        let t = parse(&format!("\n{}\n{req}", header_line(&p))).unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!(t.generator(), Some(&p));
        assert_eq!(t.requests()[0].line, 3);
        assert_eq!(parse(req).unwrap().generator(), None);
        // Not on a later line.
        let err = parse(&format!("{req}{}\n", header_line(&p))).unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");
        assert!(
            err.to_string().contains("only allowed on the first line"),
            "{err}"
        );
        // A header alone is no trace.
        assert!(matches!(
            parse(&format!("{}\n", header_line(&p))),
            Err(TraceError::Empty { .. })
        ));
        // Unknown version, unknown or missing parameter, bad value.
        let line = header_line(&p);
        for bad in [
            line.replace("\"kvpool_trace_gen\":1", "\"kvpool_trace_gen\":99"),
            line.replace("\"seed\":3", "\"seed\":3,\"colour\":1"),
            line.replace("\"seed\":3,", ""),
            line.replace("\"rate_rps\":3.0", "\"rate_rps\":-1.0"),
        ] {
            assert_ne!(bad, line);
            let err = parse(&format!("{bad}\n{req}")).unwrap_err();
            assert!(err.to_string().contains("line 1"), "{err}");
        }
    }
}

//! Server-sent events: an incremental reader of `data:` events (what vLLM
//! and our engine stream) and the writer of ours.

use axum::body::Bytes;

/// Longest event accepted, bytes; a longer one is an error, not a buffer
/// that grows with whatever the peer sends.
pub const MAX_EVENT_BYTES: usize = 1 << 20;

/// One event's data, or the stream's end marker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The data lines of one event, joined by `\n`.
    Data(String),
    /// `data: [DONE]`.
    Done,
}

/// Splits a byte stream into events. Feed it chunks as they arrive; it
/// returns the events they complete. Lines other than `data:` (comments,
/// `event:`, `id:`) are skipped; `\n` and `\r\n` line ends are both read.
#[derive(Debug, Default)]
pub struct Reader {
    buf: Vec<u8>,
    /// Bytes at the start of `buf` known to hold no line end (a line that
    /// arrives in pieces is searched once, not from its start each time).
    scanned: usize,
    data: Vec<String>,
    /// The event's size so far: its data lines, one more byte each (so
    /// that endless empty lines count too).
    data_bytes: usize,
}

/// An event longer than [`MAX_EVENT_BYTES`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("an event of the stream is longer than {MAX_EVENT_BYTES} bytes")]
pub struct TooLong;

impl Reader {
    /// A reader with nothing buffered.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads `chunk`, appending the events it completes to `out`.
    pub fn feed(&mut self, chunk: &[u8], out: &mut Vec<Event>) -> Result<(), TooLong> {
        self.buf.extend_from_slice(chunk);
        let mut start = 0;
        let mut from = self.scanned;
        while let Some(nl) = self.buf[from..].iter().position(|&b| b == b'\n') {
            let nl = from - start + nl;
            let end = start + nl;
            let mut line = &self.buf[start..end];
            if line.last() == Some(&b'\r') {
                line = &line[..line.len() - 1];
            }
            if line.is_empty() {
                if !self.data.is_empty() {
                    let data = self.data.join("\n");
                    self.data.clear();
                    self.data_bytes = 0;
                    out.push(if data == "[DONE]" {
                        Event::Done
                    } else {
                        Event::Data(data)
                    });
                }
            } else if let Some(v) = line.strip_prefix(b"data:") {
                let v = v.strip_prefix(b" ").unwrap_or(v);
                self.data_bytes += v.len() + 1;
                self.data.push(String::from_utf8_lossy(v).into_owned());
            }
            start = end + 1;
            from = start;
        }
        self.buf.drain(..start);
        self.scanned = self.buf.len();
        let pending = self.buf.len() + self.data_bytes;
        if pending > MAX_EVENT_BYTES {
            return Err(TooLong);
        }
        Ok(())
    }
}

/// `data: <v>\n\n`.
pub fn event(v: &serde_json::Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// `data: [DONE]\n\n`.
pub fn done() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_chunks_and_line_ends_are_read() {
        let mut r = Reader::new();
        let mut out = Vec::new();
        let text =
            b": comment\r\ndata: {\"a\":1}\r\n\r\ndata: x\ndata: y\n\nevent: e\ndata: [DONE]\n\n";
        for b in text.chunks(3) {
            r.feed(b, &mut out).unwrap();
        }
        assert_eq!(
            out,
            vec![
                Event::Data("{\"a\":1}".into()),
                Event::Data("x\ny".into()),
                Event::Done
            ]
        );
    }

    /// Finding 6 of the RESP/HTTP review: empty `data:` lines were kept
    /// (one empty string each) but counted as nothing, so an event of
    /// endless empty data lines grew without bound.
    #[test]
    fn an_endless_event_of_empty_data_lines_is_an_error() {
        let mut r = Reader::new();
        let mut out = Vec::new();
        let lines = b"data:\n".repeat(1000);
        let mut failed = false;
        // Each line counts one byte at least: 2 MiB of lines' worth.
        for _ in 0..(2 * MAX_EVENT_BYTES / 1000) {
            if r.feed(&lines, &mut out).is_err() {
                failed = true;
                break;
            }
        }
        assert!(failed);
        assert!(out.is_empty());
    }

    #[test]
    fn an_endless_event_is_an_error() {
        let mut r = Reader::new();
        let mut out = Vec::new();
        let line = vec![b'a'; 64 * 1024];
        let mut failed = false;
        for _ in 0..32 {
            if r.feed(&line, &mut out).is_err() {
                failed = true;
                break;
            }
        }
        assert!(failed);
        assert!(out.is_empty());
    }
}

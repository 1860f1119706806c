//! A small HTTP/1.1 client for the serving path (conductor -> proxy ->
//! engine): one connection per request, every step under a deadline, the
//! answer's body read frame by frame (streams) or whole up to a limit.
//!
//! One connection per request, not a pool: on loopback a connect costs tens
//! of microseconds against milliseconds of model time, and a connection that
//! belongs to one request dies with it, so an engine killed mid-request
//! shows as that request's broken body and never poisons the next one.

use std::time::Duration;

use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::time::{timeout_at, Instant};

/// Why an HTTP exchange failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HttpError {
    /// No connection (refused, unreachable, or not within the connect
    /// deadline): nothing was sent.
    #[error("cannot connect to {addr}: {reason}")]
    Connect {
        /// The peer.
        addr: String,
        /// Why.
        reason: String,
    },
    /// The deadline passed.
    #[error("{addr}: no answer within the deadline")]
    Timeout {
        /// The peer.
        addr: String,
    },
    /// The connection broke after the request was sent (or the answer was
    /// not HTTP).
    #[error("{addr}: {reason}")]
    Broken {
        /// The peer.
        addr: String,
        /// Why.
        reason: String,
    },
    /// The answer's body is larger than allowed.
    #[error("{addr}: the answer is larger than {limit} bytes")]
    TooLarge {
        /// The peer.
        addr: String,
        /// The limit.
        limit: usize,
    },
}

impl HttpError {
    /// Whether the request may have reached the peer (not a connect error).
    pub fn was_sent(&self) -> bool {
        !matches!(self, HttpError::Connect { .. })
    }
}

/// `host:port` of an address given as `host:port` or `http://host:port[/]`.
pub fn host_port(addr: &str) -> &str {
    let a = addr.strip_prefix("http://").unwrap_or(addr);
    a.trim_end_matches('/')
}

/// An answer whose body has not been read yet.
pub struct Answer {
    /// The peer.
    pub addr: String,
    /// Status and headers.
    pub head: hyper::http::response::Parts,
    /// The body, or why there is none ([`Answer::failed`]).
    body: Result<Incoming, String>,
    deadline: Instant,
}

impl Answer {
    /// An answer that never came: status 502, and reading its body fails
    /// with `why` (for callers that treat "could not open" like "broke").
    pub fn failed(addr: &str, why: String) -> Self {
        let (mut head, ()) = Response::new(()).into_parts();
        head.status = StatusCode::BAD_GATEWAY;
        Self {
            addr: addr.to_string(),
            head,
            body: Err(why),
            deadline: Instant::now(),
        }
    }

    /// The status.
    pub fn status(&self) -> StatusCode {
        self.head.status
    }

    /// A header as text, if present and printable.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The next piece of the body, `None` at its end; each wait ends at
    /// the answer's deadline or at `until`, whichever is first.
    pub async fn chunk(&mut self, until: Option<Instant>) -> Result<Option<Bytes>, HttpError> {
        let end = until.map_or(self.deadline, |u| u.min(self.deadline));
        let body = match &mut self.body {
            Ok(b) => b,
            Err(why) => {
                return Err(HttpError::Broken {
                    addr: self.addr.clone(),
                    reason: why.clone(),
                })
            }
        };
        loop {
            let frame = match timeout_at(end, body.frame()).await {
                Err(_) => {
                    return Err(HttpError::Timeout {
                        addr: self.addr.clone(),
                    })
                }
                Ok(None) => return Ok(None),
                Ok(Some(Err(e))) => {
                    return Err(HttpError::Broken {
                        addr: self.addr.clone(),
                        reason: format!("the answer broke off: {e}"),
                    })
                }
                Ok(Some(Ok(f))) => f,
            };
            if let Ok(data) = frame.into_data() {
                if !data.is_empty() {
                    return Ok(Some(data));
                }
            }
        }
    }

    /// The whole body, at most `limit` bytes.
    pub async fn bytes(mut self, limit: usize) -> Result<Bytes, HttpError> {
        let mut out = Vec::new();
        while let Some(c) = self.chunk(None).await? {
            if out.len() + c.len() > limit {
                return Err(HttpError::TooLarge {
                    addr: self.addr.clone(),
                    limit,
                });
            }
            out.extend_from_slice(&c);
        }
        Ok(Bytes::from(out))
    }
}

/// Sends one request to `addr` (`host:port`) and returns the answer's head
/// once it arrives; its body is read from the [`Answer`]. Connecting must
/// take at most `connect_timeout`, everything at most until `deadline`.
pub async fn send(
    addr: &str,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Bytes>,
    connect_timeout: Duration,
    deadline: Instant,
) -> Result<Answer, HttpError> {
    let addr = host_port(addr).to_string();
    let connect_by = deadline.min(Instant::now() + connect_timeout);
    let stream = match timeout_at(connect_by, tokio::net::TcpStream::connect(&addr)).await {
        Err(_) => {
            return Err(HttpError::Connect {
                addr,
                reason: "no connection within the deadline".into(),
            })
        }
        Ok(Err(e)) => {
            return Err(HttpError::Connect {
                addr,
                reason: e.to_string(),
            })
        }
        Ok(Ok(s)) => s,
    };
    let _ = stream.set_nodelay(true);
    let broken = |reason: String| HttpError::Broken {
        addr: addr.clone(),
        reason,
    };
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| broken(format!("HTTP handshake: {e}")))?;
    // The connection task ends with the exchange (or when the answer is
    // dropped).
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, addr.as_str());
    for (k, v) in headers {
        let (Ok(k), Ok(v)) = (HeaderName::try_from(*k), HeaderValue::try_from(*v)) else {
            continue;
        };
        req = req.header(k, v);
    }
    let has_body = body.is_some();
    if has_body {
        req = req.header(hyper::header::CONTENT_TYPE, "application/json");
    }
    let req = req
        .body(Full::new(body.unwrap_or_default()))
        .map_err(|e| broken(format!("bad request: {e}")))?;
    let resp: Response<Incoming> = match timeout_at(deadline, sender.send_request(req)).await {
        Err(_) => return Err(HttpError::Timeout { addr }),
        Ok(Err(e)) => return Err(broken(format!("no answer: {e}"))),
        Ok(Ok(r)) => r,
    };
    let (head, body) = resp.into_parts();
    Ok(Answer {
        addr,
        head,
        body: Ok(body),
        deadline,
    })
}

/// GET `path` and read the whole body (at most `limit` bytes); non-2xx is
/// returned as it is, with its body.
pub async fn get(
    addr: &str,
    path: &str,
    limit: usize,
    timeout: Duration,
) -> Result<(StatusCode, Bytes), HttpError> {
    let deadline = Instant::now() + timeout;
    let a = send(addr, Method::GET, path, &[], None, timeout, deadline).await?;
    let status = a.status();
    Ok((status, a.bytes(limit).await?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_take_an_optional_scheme() {
        assert_eq!(host_port("127.0.0.1:8000"), "127.0.0.1:8000");
        assert_eq!(host_port("http://127.0.0.1:8000/"), "127.0.0.1:8000");
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error_and_a_silent_peer_a_timeout() {
        let free = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        };
        let e = get(&free, "/", 100, Duration::from_secs(2))
            .await
            .unwrap_err();
        assert!(matches!(e, HttpError::Connect { .. }), "{e}");
        assert!(!e.was_sent());
        // Accepts and never answers.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let hold = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(10)).await;
            drop(s);
        });
        let e = get(&addr, "/", 100, Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(matches!(e, HttpError::Timeout { .. }), "{e}");
        hold.abort();
    }
}

//! The error codes of kvpool. They are part of the wire protocol: a code never
//! changes meaning, new codes get new numbers.

use std::fmt;

/// Every error a kvpool call can end with. The numeric code (`as u16`) is
/// what travels on the wire and what the CLI prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ErrorCode {
    /// A parameter is out of range: empty key, zero length, zero replicas,
    /// key over 4 KiB, value over the configured maximum, a bad segment size.
    InvalidParams = 1,
    /// No object under this key.
    ObjectNotFound = 2,
    /// The key is complete or still being put.
    ObjectAlreadyExists = 3,
    /// The object is still being put (Processing).
    ReplicaNotReady = 4,
    /// The object is leased by a reader; retry after the lease or force.
    ObjectHasLease = 5,
    /// The call came from a client that does not own the object's put.
    IllegalClient = 6,
    /// No segment has room, even after eviction.
    NoSpace = 7,
    /// The segment is not mounted (or was replaced after a restart).
    SegmentNotFound = 8,
    /// A deadline passed.
    Timeout = 9,
    /// A frame could not be parsed or validated.
    Malformed = 10,
    /// A protocol version or message kind this peer does not speak.
    Unsupported = 11,
    /// A frame or value over the configured maximum.
    TooLarge = 12,
    /// A peer is gone, refused the connection, or is shutting down.
    Unavailable = 13,
    /// A limit was reached: key count, connections, in-flight requests.
    ResourceExhausted = 14,
    /// A bug or an I/O failure inside the peer.
    Internal = 15,
    /// Stored bytes failed their checksum.
    Corrupt = 16,
    /// The peer requires the cluster secret: no valid proof or grant came.
    Unauthenticated = 17,
    /// Not possible now, but soon: space is on its way out (demotions to
    /// NVMe, ending leases). Retry within the deadline.
    TryAgain = 18,
    /// The master asked is not the leader (a standby, or a leader whose
    /// lease ran out): ask the leader; the message names it when known.
    /// Nothing was done, so the call may be sent again.
    NotLeader = 19,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 19] = [
        Self::InvalidParams,
        Self::ObjectNotFound,
        Self::ObjectAlreadyExists,
        Self::ReplicaNotReady,
        Self::ObjectHasLease,
        Self::IllegalClient,
        Self::NoSpace,
        Self::SegmentNotFound,
        Self::Timeout,
        Self::Malformed,
        Self::Unsupported,
        Self::TooLarge,
        Self::Unavailable,
        Self::ResourceExhausted,
        Self::Internal,
        Self::Corrupt,
        Self::Unauthenticated,
        Self::TryAgain,
        Self::NotLeader,
    ];

    pub fn code(self) -> u16 {
        self as u16
    }

    /// The code for a number from the wire; unknown numbers (a newer peer)
    /// read as `Internal` so that the message still reaches the user.
    pub fn from_code(code: u16) -> Self {
        Self::ALL
            .iter()
            .copied()
            .find(|c| c.code() == code)
            .unwrap_or(Self::Internal)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::InvalidParams => "InvalidParams",
            Self::ObjectNotFound => "ObjectNotFound",
            Self::ObjectAlreadyExists => "ObjectAlreadyExists",
            Self::ReplicaNotReady => "ReplicaNotReady",
            Self::ObjectHasLease => "ObjectHasLease",
            Self::IllegalClient => "IllegalClient",
            Self::NoSpace => "NoSpace",
            Self::SegmentNotFound => "SegmentNotFound",
            Self::Timeout => "Timeout",
            Self::Malformed => "Malformed",
            Self::Unsupported => "Unsupported",
            Self::TooLarge => "TooLarge",
            Self::Unavailable => "Unavailable",
            Self::ResourceExhausted => "ResourceExhausted",
            Self::Internal => "Internal",
            Self::Corrupt => "Corrupt",
            Self::Unauthenticated => "Unauthenticated",
            Self::TryAgain => "TryAgain",
            Self::NotLeader => "NotLeader",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An error with its code and a message saying why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvError {
    pub code: ErrorCode,
    pub message: String,
}

impl KvError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

impl fmt::Display for KvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.code, self.code.code(), self.message)
    }
}

impl std::error::Error for KvError {}

impl From<std::io::Error> for KvError {
    fn from(e: std::io::Error) -> Self {
        use std::io::ErrorKind::*;
        let code = match e.kind() {
            TimedOut | WouldBlock => ErrorCode::Timeout,
            ConnectionRefused | ConnectionReset | ConnectionAborted | BrokenPipe
            | UnexpectedEof | NotConnected => ErrorCode::Unavailable,
            _ => ErrorCode::Internal,
        };
        KvError::new(code, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_unique_and_round_trip() {
        let mut seen = std::collections::HashSet::new();
        for c in ErrorCode::ALL {
            assert!(seen.insert(c.code()));
            assert_eq!(ErrorCode::from_code(c.code()), c);
        }
        assert_eq!(ErrorCode::from_code(999), ErrorCode::Internal);
    }

    #[test]
    fn codes_never_change_meaning() {
        // Pinned: these numbers are on the wire and in users' scripts.
        assert_eq!(ErrorCode::InvalidParams.code(), 1);
        assert_eq!(ErrorCode::ObjectNotFound.code(), 2);
        assert_eq!(ErrorCode::NoSpace.code(), 7);
        assert_eq!(ErrorCode::Timeout.code(), 9);
        assert_eq!(ErrorCode::Corrupt.code(), 16);
        assert_eq!(ErrorCode::Unauthenticated.code(), 17);
        assert_eq!(ErrorCode::TryAgain.code(), 18);
        assert_eq!(ErrorCode::NotLeader.code(), 19);
    }
}

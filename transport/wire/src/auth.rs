//! Who may do what: the cluster secret, the master's connection handshake
//! and the data-plane grants.
//!
//! ```text
//!  master RPC (once per connection, before any other request)
//!   client                                     master
//!     AuthBegin { client_id, nonce_c }   ->
//!                                        <-    AuthChallenge { nonce_s }
//!     AuthProve { mac(c | id | nonce_c | nonce_s) } ->   checks; the connection
//!                                        <-    AuthOk { mac(s | id | nonce_c | nonce_s) }   speaks for client_id
//!  data plane (every request, no round trip)
//!   master: grant = mac(op | segment | offset | len | expires_ms | term)  in each ReplicaDesc
//!   client: Write / Read / ReadNvme / Rdma Connect / shm map carry the grant
//!   node:   checks the mac, the expiry (its clock, with a skew allowance) and
//!           that the request's range lies inside the granted one
//! ```
//!
//! Every MAC is HMAC-SHA256 keyed with the cluster secret and a domain label,
//! so a MAC made for one purpose never passes for another. Grants carry the
//! first 16 bytes of theirs (128 bits). Without a secret the cluster is open:
//! grants are empty and nothing is checked (the loopback default).

use std::time::{SystemTime, UNIX_EPOCH};

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::error::{ErrorCode, KvError};
/// The grant travels in the wire messages, so it is declared with them.
pub use crate::proto::Grant;
use crate::proto::SegmentId;

type HmacSha256 = Hmac<Sha256>;

/// Shortest secret accepted: 16 bytes (128 bits) of whatever the operator
/// chose; a longer random string is better.
pub const MIN_SECRET_BYTES: usize = 16;

/// Length of the nonces of the handshake.
pub const NONCE_BYTES: usize = 16;

/// What a data-plane grant allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum GrantOp {
    /// Write bytes into a DRAM range (a put).
    Write = 1,
    /// Read bytes of a DRAM range (a get), or map the segment (shm) or
    /// connect queue pairs to it (RDMA) on the strength of such a grant.
    Read = 2,
    /// Read an object of a node's NVMe tier.
    ReadNvme = 3,
}

/// When a grant is checked: this machine's Unix time, and how far the
/// master's clock may be ahead of it (a grant is accepted that long after
/// its expiry).
#[derive(Debug, Clone, Copy)]
pub struct GrantClock {
    pub now_ms: u64,
    pub skew_ms: u64,
}

impl GrantClock {
    /// This machine's clock now, with `skew_ms` of allowance.
    pub fn now(skew_ms: u64) -> Self {
        Self {
            now_ms: unix_ms(),
            skew_ms,
        }
    }
}

/// Milliseconds since the Unix epoch by this machine's clock.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn unauthenticated(why: impl Into<String>) -> KvError {
    KvError::new(ErrorCode::Unauthenticated, why)
}

/// The cluster secret, keyed once; cheap to clone and share.
#[derive(Clone)]
pub struct ClusterKey {
    mac: HmacSha256,
}

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(..)")
    }
}

impl ClusterKey {
    /// Keys HMAC-SHA256 with `secret`; refuses one shorter than
    /// [`MIN_SECRET_BYTES`].
    pub fn new(secret: &[u8]) -> Result<Self, String> {
        if secret.len() < MIN_SECRET_BYTES {
            return Err(format!(
                "the cluster secret must be at least {MIN_SECRET_BYTES} bytes (it is {})",
                secret.len()
            ));
        }
        let mac = HmacSha256::new_from_slice(secret).map_err(|e| e.to_string())?;
        Ok(Self { mac })
    }

    fn keyed(&self, label: &[u8]) -> HmacSha256 {
        let mut m = self.mac.clone();
        m.update(label);
        m
    }

    fn handshake_mac(&self, label: &[u8], client_id: u64, nc: &[u8], ns: &[u8]) -> [u8; 32] {
        let mut m = self.keyed(label);
        m.update(&client_id.to_le_bytes());
        m.update(nc);
        m.update(ns);
        m.finalize().into_bytes().into()
    }

    /// The client's answer to the master's challenge.
    pub fn client_proof(&self, client_id: u64, nc: &[u8], ns: &[u8]) -> [u8; 32] {
        self.handshake_mac(b"kvpool-auth-client-v1", client_id, nc, ns)
    }

    /// The master's proof that it holds the secret too.
    pub fn server_proof(&self, client_id: u64, nc: &[u8], ns: &[u8]) -> [u8; 32] {
        self.handshake_mac(b"kvpool-auth-server-v1", client_id, nc, ns)
    }

    fn verify_handshake(
        &self,
        label: &[u8],
        client_id: u64,
        nc: &[u8],
        ns: &[u8],
        proof: &[u8],
    ) -> Result<(), KvError> {
        let mut m = self.keyed(label);
        m.update(&client_id.to_le_bytes());
        m.update(nc);
        m.update(ns);
        m.verify_slice(proof)
            .map_err(|_| unauthenticated("the proof does not match the cluster secret"))
    }

    /// A data connection's answer to a storage node's challenge: labelled
    /// apart from the master handshake's, so that neither side's proof can
    /// be relayed into the other handshake.
    pub fn data_client_proof(&self, client_id: u64, nc: &[u8], ns: &[u8]) -> [u8; 32] {
        self.handshake_mac(b"kvpool-data-auth-client-v1", client_id, nc, ns)
    }

    /// The storage node's proof on a data connection.
    pub fn data_server_proof(&self, client_id: u64, nc: &[u8], ns: &[u8]) -> [u8; 32] {
        self.handshake_mac(b"kvpool-data-auth-server-v1", client_id, nc, ns)
    }

    /// Checks a data connection's proof (constant time).
    pub fn verify_data_client_proof(
        &self,
        client_id: u64,
        nc: &[u8],
        ns: &[u8],
        proof: &[u8],
    ) -> Result<(), KvError> {
        self.verify_handshake(b"kvpool-data-auth-client-v1", client_id, nc, ns, proof)
    }

    /// Checks a storage node's proof (constant time).
    pub fn verify_data_server_proof(
        &self,
        client_id: u64,
        nc: &[u8],
        ns: &[u8],
        proof: &[u8],
    ) -> Result<(), KvError> {
        self.verify_handshake(b"kvpool-data-auth-server-v1", client_id, nc, ns, proof)
    }

    /// Checks a client's proof (constant time).
    pub fn verify_client_proof(
        &self,
        client_id: u64,
        nc: &[u8],
        ns: &[u8],
        proof: &[u8],
    ) -> Result<(), KvError> {
        self.verify_handshake(b"kvpool-auth-client-v1", client_id, nc, ns, proof)
    }

    /// Checks the master's proof (constant time).
    pub fn verify_server_proof(
        &self,
        client_id: u64,
        nc: &[u8],
        ns: &[u8],
        proof: &[u8],
    ) -> Result<(), KvError> {
        self.verify_handshake(b"kvpool-auth-server-v1", client_id, nc, ns, proof)
    }

    fn grant_mac(&self, segment: SegmentId, g: &Grant) -> HmacSha256 {
        let mut m = self.keyed(b"kvpool-grant-v1");
        m.update(&[g.op]);
        m.update(&segment.to_le_bytes());
        m.update(&g.offset.to_le_bytes());
        m.update(&g.len.to_le_bytes());
        m.update(&g.expires_ms.to_le_bytes());
        m.update(&g.term.to_le_bytes());
        m
    }

    /// Signs a grant of `op` on `len` bytes at `offset` of `segment`, by
    /// the leader of `term`.
    pub fn grant(
        &self,
        op: GrantOp,
        segment: SegmentId,
        (offset, len): (u64, u64),
        expires_ms: u64,
        term: u64,
    ) -> Grant {
        let mut g = Grant {
            op: op as u8,
            offset,
            len,
            expires_ms,
            term,
            mac: [0; 16],
        };
        let full = self.grant_mac(segment, &g).finalize().into_bytes();
        g.mac.copy_from_slice(&full[..16]);
        g
    }

    /// Checks that `g` is a live grant (by `clock`) the master signed for
    /// `op` on `segment` covering `offset..offset+len`.
    pub fn check_grant(
        &self,
        g: &Grant,
        op: GrantOp,
        segment: SegmentId,
        (offset, len): (u64, u64),
        clock: GrantClock,
    ) -> Result<(), KvError> {
        let (now_unix_ms, skew_ms) = (clock.now_ms, clock.skew_ms);
        if g.op != op as u8 {
            return Err(unauthenticated(format!(
                "the grant is for operation {}, not {op:?}",
                g.op
            )));
        }
        self.grant_mac(segment, g)
            .verify_truncated_left(&g.mac)
            .map_err(|_| unauthenticated("the grant's signature does not match"))?;
        if now_unix_ms > g.expires_ms.saturating_add(skew_ms) {
            return Err(unauthenticated(format!(
                "the grant expired {} ms ago",
                now_unix_ms - g.expires_ms
            )));
        }
        if !g.covers(offset, len) {
            return Err(unauthenticated(format!(
                "{len} bytes at {offset} lie outside the granted {} bytes at {}",
                g.len, g.offset
            )));
        }
        Ok(())
    }

    /// A local process's proof on a segment's shm socket that it holds the
    /// secret: bound to the node's nonce `ns`, the segment and the grant it
    /// shows, labelled apart from every other proof.
    pub fn shm_proof(&self, segment: SegmentId, ns: &[u8], grant: &Grant) -> [u8; 32] {
        self.handshake_mac(b"kvpool-shm-map-v1", segment, ns, &grant.mac)
    }

    /// Checks an shm proof (constant time).
    pub fn verify_shm_proof(
        &self,
        segment: SegmentId,
        ns: &[u8],
        grant: &Grant,
        proof: &[u8],
    ) -> Result<(), KvError> {
        self.verify_handshake(b"kvpool-shm-map-v1", segment, ns, &grant.mac, proof)
            .map_err(|_| unauthenticated("the shm proof does not match the cluster secret"))
    }

    /// Checks a grant for any access to `segment` (shm mapping, RDMA
    /// connection): a read or write grant that is live and signed for it.
    pub fn check_segment_access(
        &self,
        g: &Grant,
        segment: SegmentId,
        clock: GrantClock,
    ) -> Result<(), KvError> {
        let op = match g.op {
            x if x == GrantOp::Write as u8 => GrantOp::Write,
            x if x == GrantOp::Read as u8 => GrantOp::Read,
            other => {
                return Err(unauthenticated(format!(
                    "operation {other} does not give access to a segment"
                )))
            }
        };
        self.check_grant(g, op, segment, (g.offset, g.len), clock)
    }
}

/// A fresh random nonce (rand's thread-local CSPRNG, seeded by the OS).
pub fn nonce() -> [u8; NONCE_BYTES] {
    rand::random()
}

/// Compares two byte strings in time that depends on their length only.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(now_ms: u64, skew_ms: u64) -> GrantClock {
        GrantClock { now_ms, skew_ms }
    }

    fn key() -> ClusterKey {
        ClusterKey::new(b"0123456789abcdef-test").unwrap()
    }

    #[test]
    fn a_short_secret_is_refused() {
        assert!(ClusterKey::new(b"short").is_err());
    }

    #[test]
    fn handshake_proofs_verify_only_with_the_same_secret_and_nonces() {
        let k = key();
        let other = ClusterKey::new(b"another secret of 16+ bytes").unwrap();
        let (nc, ns) = (nonce(), nonce());
        let p = k.client_proof(7, &nc, &ns);
        assert!(k.verify_client_proof(7, &nc, &ns, &p).is_ok());
        assert!(other.verify_client_proof(7, &nc, &ns, &p).is_err());
        assert!(k.verify_client_proof(8, &nc, &ns, &p).is_err());
        assert!(k.verify_client_proof(7, &ns, &nc, &p).is_err());
        // A client proof never passes as the server's.
        assert!(k.verify_server_proof(7, &nc, &ns, &p).is_err());
        let s = k.server_proof(7, &nc, &ns);
        assert!(k.verify_server_proof(7, &nc, &ns, &s).is_ok());
    }

    #[test]
    fn a_grant_checks_op_segment_range_expiry_and_signature() {
        let k = key();
        let g = k.grant(GrantOp::Write, 42, (4096, 8192), 1_000, 5);
        assert!(k
            .check_grant(&g, GrantOp::Write, 42, (4096, 8192), at(900, 0))
            .is_ok());
        // A slice of the range is covered.
        assert!(k
            .check_grant(&g, GrantOp::Write, 42, (8192, 4096), at(900, 0))
            .is_ok());
        let e = k
            .check_grant(&g, GrantOp::Write, 42, (0, 4096), at(900, 0))
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::Unauthenticated);
        assert!(k
            .check_grant(&g, GrantOp::Write, 42, (8192, 4097), at(900, 0))
            .is_err());
        assert!(k
            .check_grant(&g, GrantOp::Read, 42, (4096, 8192), at(900, 0))
            .is_err());
        assert!(k
            .check_grant(&g, GrantOp::Write, 43, (4096, 8192), at(900, 0))
            .is_err());
        // Expiry, with the skew allowance.
        assert!(k
            .check_grant(&g, GrantOp::Write, 42, (4096, 8192), at(1_500, 0))
            .is_err());
        assert!(k
            .check_grant(&g, GrantOp::Write, 42, (4096, 8192), at(1_500, 600))
            .is_ok());
        // A changed field breaks the signature.
        for f in 0..5 {
            let mut h = g;
            match f {
                0 => h.offset = 0,
                1 => h.len = 1 << 40,
                2 => h.expires_ms = u64::MAX,
                // A deposed leader's grant cannot be passed off as newer.
                3 => h.term = 6,
                _ => h.mac[3] ^= 1,
            }
            assert!(
                k.check_grant(&h, GrantOp::Write, 42, (h.offset, 1), at(900, 0))
                    .is_err(),
                "field {f}"
            );
        }
        // An empty grant (open cluster) never passes a keyed check.
        let open = Grant::default();
        assert!(k.check_segment_access(&open, 42, at(0, 0)).is_err());
        assert!(k.check_segment_access(&g, 42, at(900, 0)).is_ok());
    }

    #[test]
    fn covers_does_not_overflow() {
        let g = Grant {
            offset: u64::MAX - 10,
            len: 100,
            ..Default::default()
        };
        assert!(!g.covers(u64::MAX - 5, 1));
        let g = Grant {
            offset: 0,
            len: 100,
            ..Default::default()
        };
        assert!(!g.covers(u64::MAX, 2));
        assert!(g.covers(99, 1));
        assert!(!g.covers(99, 2));
    }
}

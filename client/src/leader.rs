//! Where a client finds the master: a fixed `host:port`, or a scheme such
//! as `etcd://h1:2379,h2:2379` that names where the leader of several
//! masters is published.
//!
//! The client crate links no election or etcd code: a scheme is resolved
//! by a [`MasterSource`] that the program registers at start
//! ([`register_scheme`]; the `kvpool` binary registers `etcd` from
//! `kvpool-ha`). A client given such an address asks its source for the
//! leader when it connects, and again when the master it speaks to answers
//! `NotLeader`, cannot be reached, lets a call run out of time, or the
//! source learns that another master was elected (a stalled leader is left
//! at the election, not at the call's deadline); each wait is bounded by the
//! call's deadline.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};

use kvpool_wire::{ErrorCode, KvError};

/// A boxed future of a source's answer.
pub type Resolving<'a> = Pin<Box<dyn Future<Output = Result<String, KvError>> + Send + 'a>>;

/// A boxed future that completes when the leader has moved.
pub type Moved<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// Says where the master (the leader) is now.
pub trait MasterSource: Send + Sync {
    /// The leader's RPC address (`host:port` of its shard 0). No deadline of
    /// its own: callers bound it.
    fn resolve(&self) -> Resolving<'_>;

    /// Whether the answer can change (a fixed address never does: a
    /// client then never re-resolves).
    fn follows(&self) -> bool;

    /// What the source is, for messages (`etcd://...`, `host:port`).
    fn describe(&self) -> String;

    /// Completes once the source knows that a master other than the one at
    /// `addr` leads (it follows the election): a call to `addr` still
    /// waiting then ends at once instead of at its deadline. A source that
    /// cannot tell (a fixed address) never completes.
    fn moved_from<'a>(&'a self, addr: &'a str) -> Moved<'a> {
        let _ = addr;
        Box::pin(std::future::pending())
    }
}

/// A fixed `host:port`.
pub struct Fixed(pub String);

impl MasterSource for Fixed {
    fn resolve(&self) -> Resolving<'_> {
        let addr = self.0.clone();
        Box::pin(async move { Ok(addr) })
    }

    fn follows(&self) -> bool {
        false
    }

    fn describe(&self) -> String {
        self.0.clone()
    }
}

/// Makes a source from an address with the registered scheme.
pub type SchemeFactory = fn(&str) -> Result<Arc<dyn MasterSource>, KvError>;

fn schemes() -> &'static Mutex<Vec<(&'static str, SchemeFactory)>> {
    static SCHEMES: OnceLock<Mutex<Vec<(&'static str, SchemeFactory)>>> = OnceLock::new();
    SCHEMES.get_or_init(|| Mutex::new(Vec::new()))
}

/// Lets addresses `scheme://...` be resolved by `factory` in this process
/// (registering a scheme again replaces it).
pub fn register_scheme(scheme: &'static str, factory: SchemeFactory) {
    let mut s = schemes().lock().unwrap_or_else(|p| p.into_inner());
    s.retain(|(name, _)| *name != scheme);
    s.push((scheme, factory));
}

/// The source for `master`: a registered scheme's, or a fixed address. A
/// scheme nobody registered is `Unsupported`, naming it.
pub fn source_for(master: &str) -> Result<Arc<dyn MasterSource>, KvError> {
    let Some((scheme, _)) = master.split_once("://") else {
        return Ok(Arc::new(Fixed(master.to_string())));
    };
    let factory = {
        let s = schemes().lock().unwrap_or_else(|p| p.into_inner());
        s.iter().find(|(name, _)| *name == scheme).map(|(_, f)| *f)
    };
    match factory {
        Some(f) => f(master),
        None => Err(KvError::new(
            ErrorCode::Unsupported,
            format!(
                "{master}: this program cannot resolve {scheme}:// master addresses \
                 (the kvpool binary can; an embedder registers a source with \
                 kvpool_client::register_scheme)"
            ),
        )),
    }
}

/// Whether an error from a master says to look for the leader again: it is
/// not the leader, or it could not be reached or did not answer in time.
pub fn leader_may_have_moved(e: &KvError) -> bool {
    matches!(
        e.code,
        ErrorCode::NotLeader | ErrorCode::Unavailable | ErrorCode::Timeout
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_address_is_fixed_and_an_unknown_scheme_is_refused_by_name() {
        let s = source_for("127.0.0.1:7070").unwrap();
        assert!(!s.follows());
        assert_eq!(s.describe(), "127.0.0.1:7070");
        let e = source_for("zk://h:2181").err().unwrap();
        assert_eq!(e.code, ErrorCode::Unsupported);
        assert!(e.message.contains("zk://"), "{e}");

        fn fixed_b(_: &str) -> Result<Arc<dyn MasterSource>, KvError> {
            Ok(Arc::new(Fixed("b:1".into())))
        }
        register_scheme("test-scheme", fixed_b);
        let s = source_for("test-scheme://anything").unwrap();
        assert_eq!(s.describe(), "b:1");
    }
}

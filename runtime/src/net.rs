//! Sharded listeners: shard `i` of a node listens on `base_port + i`.

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::RuntimeError;

/// How many times a `:0` base port is re-drawn when a neighbour port is taken.
const PORT_ATTEMPTS: usize = 32;

/// How long a fixed port that is in use is retried before start-up fails. A
/// process killed with io_uring operations in flight (a pending accept) keeps
/// its listening sockets bound until the kernel tears its rings down, which
/// finishes after the process is reaped, or after an embedded node's shard
/// threads have ended (Mooncake's `close()` then `setup()` on the same
/// `local_hostname` port): a node restarted at once on its own ports would
/// otherwise fail to start. On a loaded machine the teardown took more than
/// 4 s once (CI, Mooncake's `test_replication_failure_tolerance`, beside three
/// other suites), hence 10 s; an embedded node now also shuts its listeners
/// down when it stops ([`Listening`]), which frees them at once. A port
/// another live process holds still fails, once this has passed.
pub const FIXED_PORT_WAIT: Duration = Duration::from_secs(10);

/// Binds `n` consecutive ports starting at `addr`'s port. Port 0 asks the OS
/// for a free base and retries if a following port is taken. The sockets are
/// plain (no `SO_REUSEPORT`): a second process on the same ports fails loudly
/// instead of silently sharing them. A fixed port in use is retried for
/// [`FIXED_PORT_WAIT`] first.
pub fn bind_sharded(addr: &str, n: usize) -> Result<(SocketAddr, Vec<TcpListener>), RuntimeError> {
    bind_sharded_within(addr, n, FIXED_PORT_WAIT)
}

/// [`bind_sharded`] with the wait for a fixed port in use given.
pub fn bind_sharded_within(
    addr: &str,
    n: usize,
    wait: Duration,
) -> Result<(SocketAddr, Vec<TcpListener>), RuntimeError> {
    let base: SocketAddr = addr
        .to_socket_addrs()
        .map_err(|e| RuntimeError::Config(format!("bad listen address {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| {
            RuntimeError::Config(format!("listen address {addr:?} resolves to nothing"))
        })?;
    let e = if base.port() == 0 {
        let mut last_err = None;
        for _ in 0..PORT_ATTEMPTS {
            match try_bind(base, n) {
                Ok(v) => return Ok(v),
                Err(e) => last_err = Some(e),
            }
        }
        last_err.expect("at least one attempt")
    } else {
        let deadline = Instant::now() + wait;
        loop {
            match try_bind(base, n) {
                Ok(v) => return Ok(v),
                Err(e)
                    if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => break e,
            }
        }
    };
    Err(RuntimeError::Config(format!(
        "cannot listen on {n} port(s) from {addr}: {e}"
    )))
}

/// Second handles (dups) of a node's listening sockets, to stop listening
/// when the node stops. A socket shut down leaves the LISTEN state at once,
/// so its port can be bound again (both sockets have `SO_REUSEADDR`, which
/// std sets) even while the shards' io_uring rings still hold it: the kernel
/// tears a ring down after its thread ended, and a pending accept keeps the
/// socket bound until then (under load for more than 10 s: Mooncake's
/// `close()` then `setup()` on the same port failed with "Address already in
/// use").
pub struct Listening(Vec<TcpListener>);

impl Listening {
    /// Handles of `listeners` (the same sockets).
    pub fn of(listeners: &[TcpListener]) -> std::io::Result<Self> {
        let dups = listeners.iter().map(TcpListener::try_clone);
        Ok(Self(dups.collect::<std::io::Result<_>>()?))
    }

    /// Stops listening on every socket: their ports are free to bind; an
    /// accept still pending fails. Call it once the node's shards ended.
    pub fn stop(&self) {
        for l in &self.0 {
            if let Err(e) = rustix::net::shutdown(l, rustix::net::Shutdown::Both) {
                tracing::debug!("stop listening on {:?}: {e}", l.local_addr());
            }
        }
    }
}

fn try_bind(base: SocketAddr, n: usize) -> std::io::Result<(SocketAddr, Vec<TcpListener>)> {
    let first = TcpListener::bind(base)?;
    let bound = first.local_addr()?;
    let mut all = vec![first];
    for i in 1..n {
        let port = bound
            .port()
            .checked_add(i as u16)
            .filter(|_| i < u16::MAX as usize)
            .ok_or_else(|| std::io::Error::other("port range runs past 65535"))?;
        let mut a = bound;
        a.set_port(port);
        all.push(TcpListener::bind(a)?);
    }
    Ok((bound, all))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binds_consecutive_ports_from_an_ephemeral_base() {
        let (addr, ls) = bind_sharded("127.0.0.1:0", 3).unwrap();
        assert_eq!(ls.len(), 3);
        for (i, l) in ls.iter().enumerate() {
            assert_eq!(l.local_addr().unwrap().port(), addr.port() + i as u16);
        }
    }

    /// A socket something else still holds (here the listeners themselves,
    /// as a torn-down ring's pending accept does) keeps its ports bound
    /// until it is shut down; then the ports can be bound again at once.
    #[test]
    fn stopped_listeners_free_their_ports_while_still_held() {
        let (addr, held) = bind_sharded("127.0.0.1:0", 2).unwrap();
        let listening = Listening::of(&held).unwrap();
        let again = |wait| bind_sharded_within(&addr.to_string(), 2, wait);
        assert!(
            again(Duration::from_millis(100)).is_err(),
            "still listening"
        );
        listening.stop();
        let (rebound, ls) = again(Duration::ZERO).expect("the ports are free once stopped");
        assert_eq!((rebound, ls.len()), (addr, 2));
        drop(held);
    }

    #[test]
    fn a_taken_port_is_an_error_naming_the_address() {
        let (addr, _held) = bind_sharded("127.0.0.1:0", 1).unwrap();
        let e = bind_sharded_within(&addr.to_string(), 1, Duration::from_millis(200)).unwrap_err();
        assert!(e.to_string().contains(&addr.to_string()), "{e}");
    }

    #[test]
    fn a_fixed_port_freed_during_the_wait_is_bound() {
        let (addr, held) = bind_sharded("127.0.0.1:0", 2).unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(held);
        });
        let (got, ls) = bind_sharded_within(&addr.to_string(), 2, Duration::from_secs(5))
            .expect("bound once the holder let go");
        assert_eq!(got, addr);
        assert_eq!(ls.len(), 2);
        release.join().unwrap();
    }
}

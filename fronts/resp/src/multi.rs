//! `MULTI` / `EXEC` / `DISCARD`: a connection's commands queued, then run in
//! order with their replies in one array (what redis-py's `pipeline()` sends
//! by default).
//!
//! What Redis promises and this front keeps: the queued commands run one
//! after another, in order, and a command refused while queueing (unknown,
//! wrong arity, not authenticated) discards the whole transaction at `EXEC`
//! (`EXECABORT`). What it does not: isolation. Other connections' commands
//! run between the queued ones (the pool is many processes; there is no
//! global lock to take), so a transaction is a batch, not a snapshot; `WATCH`
//! is refused for that reason.

use std::time::Instant;

use crate::commands::Cmd;
use crate::conn::{Close, Conn, Held, Queued, FLUSH_AT};
use crate::proto::reply;

/// Commands one transaction may queue.
pub(crate) const MAX_QUEUED: usize = 100_000;
/// What a queued argument costs beside its bytes (its `Vec`).
const ARG_OVERHEAD: u64 = 24;

impl Conn {
    /// `MULTI` outside a transaction.
    pub(crate) fn multi_start(&mut self) {
        self.multi = Some(Queued {
            cmds: Vec::new(),
            _held: Held::none(&self.ctx.shared),
            aborted: false,
        });
        self.meta.set_multi(Some(0));
        reply::ok(&mut self.out.bytes);
    }

    /// A command refused while a transaction is open discards it at `EXEC`.
    pub(crate) fn multi_refused(&mut self) {
        if let Some(q) = self.multi.as_mut() {
            q.aborted = true;
        }
    }

    /// Queues `cmd` (checked: known, arity, auth) in the open transaction.
    pub(crate) fn multi_queue(&mut self, cmd: Cmd, args: &[&[u8]]) {
        let Some(q) = self.multi.as_mut() else {
            return;
        };
        let cost: u64 = args.iter().map(|a| a.len() as u64 + ARG_OVERHEAD).sum();
        if q.cmds.len() >= MAX_QUEUED || !q._held.grow(cost) {
            q.aborted = true;
            return reply::error(
                &mut self.out.bytes,
                &format!(
                    "ERR the transaction is over its bound ({MAX_QUEUED} commands, or the \
                     front's buffer memory, resp.max_buffer_memory): EXEC will discard it"
                ),
            );
        }
        q.cmds
            .push((cmd, args.iter().map(|a| a.to_vec()).collect()));
        self.meta.set_multi(Some(q.cmds.len()));
        reply::simple(&mut self.out.bytes, "QUEUED");
    }

    /// `DISCARD` inside a transaction.
    pub(crate) fn multi_discard(&mut self) {
        self.multi = None;
        self.meta.set_multi(None);
        reply::ok(&mut self.out.bytes);
    }

    /// `EXEC` inside a transaction: every queued command in order, their
    /// replies in one array (or `EXECABORT` when one was refused).
    pub(crate) async fn multi_exec(&mut self) -> Result<(), Close> {
        let Some(q) = self.multi.take() else {
            return Ok(());
        };
        self.meta.set_multi(None);
        if q.aborted {
            reply::error(
                &mut self.out.bytes,
                "EXECABORT Transaction discarded because of previous errors.",
            );
            return Ok(());
        }
        reply::array(&mut self.out.bytes, q.cmds.len());
        for (cmd, args) in &q.cmds {
            let t = Instant::now();
            let at = self.out.bytes.len();
            let args: Vec<&[u8]> = args.iter().map(|a| a.as_slice()).collect();
            self.one(*cmd, &args).await;
            let ok = self.out.bytes.get(at) != Some(&b'-');
            self.ctx.shared.metrics.record(cmd.index(), ok, t.elapsed());
            if self.out.pending() >= FLUSH_AT {
                self.flush().await?;
            }
        }
        Ok(())
    }
}

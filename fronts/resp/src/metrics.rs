//! The front's figures: per command (calls, errors, latency) on `/metrics`
//! and in `INFO commandstats`; connections and refusals; the buffer budget.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use kvpool_runtime::metrics::prometheus_client::metrics::counter::Counter;
use kvpool_runtime::metrics::prometheus_client::metrics::family::Family;
use kvpool_runtime::metrics::prometheus_client::metrics::gauge::Gauge;
use kvpool_runtime::metrics::prometheus_client::metrics::histogram::Histogram;
use kvpool_runtime::metrics::{latency_histogram, HistFamily, MetricsRegistry, OpLabels, OpOnly};

use crate::commands::SPECS;

/// One command's handles, resolved once (the families' locks stay off the
/// request path).
pub struct CmdMetrics {
    ok: Counter,
    err: Counter,
    seconds: Histogram,
    /// Microseconds spent, for `INFO commandstats`.
    usec: AtomicU64,
}

impl CmdMetrics {
    pub fn calls(&self) -> u64 {
        self.ok.get() + self.err.get()
    }

    pub fn errors(&self) -> u64 {
        self.err.get()
    }

    pub fn usec(&self) -> u64 {
        self.usec.load(Ordering::Relaxed)
    }
}

/// Every figure of the front.
pub struct Metrics {
    cmds: Vec<CmdMetrics>,
    unknown: Counter,
    pub connections: Gauge,
    pub connections_total: Counter,
    pub rejected_connections: Counter,
    pub protocol_errors: Counter,
    pub auth_failures: Counter,
    pub buffer_bytes: Gauge,
    /// Times a read buffer was made larger.
    pub buffer_grows: Counter,
    /// Connections open now (the cap is checked against it).
    pub open: AtomicUsize,
}

impl Metrics {
    pub fn new(reg: &MetricsRegistry) -> Self {
        let calls: Family<OpLabels, Counter> = Family::default();
        let hist: HistFamily = Family::new_with_constructor(latency_histogram);
        reg.register(
            "resp_commands",
            "RESP commands by command and result (ok or error)",
            calls.clone(),
        );
        reg.register(
            "resp_command_seconds",
            "RESP command latency, from its parsing to its reply being ready",
            hist.clone(),
        );
        // One handle at a time: a family's guard must be gone before the
        // next `get_or_create` (which may take its write lock).
        let counter = |op: &'static str, result: &'static str| -> Counter {
            let c = calls.get_or_create(&OpLabels { op, result }).clone();
            c
        };
        let cmds = SPECS
            .iter()
            .map(|s| {
                let ok = counter(s.name, "ok");
                let err = counter(s.name, "error");
                let seconds = {
                    let h = hist.get_or_create(&OpOnly { op: s.name }).clone();
                    h
                };
                CmdMetrics {
                    ok,
                    err,
                    seconds,
                    usec: AtomicU64::new(0),
                }
            })
            .collect();
        let unknown = counter("unknown", "error");
        let m = Self {
            cmds,
            unknown,
            connections: Gauge::default(),
            connections_total: Counter::default(),
            rejected_connections: Counter::default(),
            protocol_errors: Counter::default(),
            auth_failures: Counter::default(),
            buffer_bytes: Gauge::default(),
            buffer_grows: Counter::default(),
            open: AtomicUsize::new(0),
        };
        reg.register(
            "resp_connections",
            "RESP connections open",
            m.connections.clone(),
        );
        reg.register(
            "resp_connections_accepted",
            "RESP connections accepted since start",
            m.connections_total.clone(),
        );
        reg.register(
            "resp_connections_rejected",
            "RESP connections refused at resp.max_clients",
            m.rejected_connections.clone(),
        );
        reg.register(
            "resp_protocol_errors",
            "RESP connections closed for a malformed request or a limit",
            m.protocol_errors.clone(),
        );
        reg.register(
            "resp_auth_failures",
            "AUTH (or HELLO AUTH) with a wrong password",
            m.auth_failures.clone(),
        );
        reg.register(
            "resp_buffer_bytes",
            "Read buffers and values held by RESP connections (resp.max_buffer_memory)",
            m.buffer_bytes.clone(),
        );
        reg.register(
            "resp_buffer_grows",
            "Times a RESP connection's read buffer was made larger",
            m.buffer_grows.clone(),
        );
        m
    }

    pub fn cmd(&self, index: usize) -> &CmdMetrics {
        &self.cmds[index]
    }

    /// Records one command's outcome.
    pub fn record(&self, index: usize, ok: bool, took: Duration) {
        let m = &self.cmds[index];
        if ok {
            m.ok.inc();
        } else {
            m.err.inc();
        }
        m.seconds.observe(took.as_secs_f64());
        m.usec.fetch_add(took.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn record_unknown(&self) {
        self.unknown.inc();
    }

    pub fn unknown_calls(&self) -> u64 {
        self.unknown.get()
    }
}

/// Memory the front's connections may hold at once (read buffers, values
/// read from other hosts); taken before it is allocated, given back when
/// freed.
pub struct Budget {
    max: u64,
    used: AtomicU64,
}

impl Budget {
    pub fn new(max: u64) -> Self {
        Self {
            max,
            used: AtomicU64::new(0),
        }
    }

    /// Takes `n` bytes if they are free.
    pub fn take(&self, n: u64) -> bool {
        let mut cur = self.used.load(Ordering::Relaxed);
        loop {
            let Some(next) = cur.checked_add(n).filter(|&v| v <= self.max) else {
                return false;
            };
            match self
                .used
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(v) => cur = v,
            }
        }
    }

    pub fn give(&self, n: u64) {
        let prev = self.used.fetch_sub(n, Ordering::AcqRel);
        debug_assert!(prev >= n, "the budget got back more than it gave");
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// More than half is in use: idle connections give their buffers back.
    pub fn pressed(&self) -> bool {
        self.used() > self.max / 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_never_hands_out_more_than_its_maximum() {
        let b = Budget::new(100);
        assert!(b.take(60));
        assert!(!b.take(41));
        assert!(b.take(40));
        assert!(!b.take(1));
        b.give(50);
        assert_eq!(b.used(), 50);
        assert!(!b.pressed());
        assert!(b.take(1));
        assert!(b.pressed());
    }

    #[test]
    fn commands_are_counted_by_result_on_the_registry() {
        let reg = MetricsRegistry::new();
        let m = Metrics::new(&reg);
        m.record(
            crate::commands::Cmd::Get.index(),
            true,
            Duration::from_micros(30),
        );
        m.record(
            crate::commands::Cmd::Get.index(),
            false,
            Duration::from_micros(10),
        );
        assert_eq!(m.cmd(0).calls(), 2);
        assert_eq!(m.cmd(0).errors(), 1);
        assert_eq!(m.cmd(0).usec(), 40);
        let text = reg.render();
        assert!(
            text.contains("kvpool_resp_commands_total{op=\"get\",result=\"ok\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kvpool_resp_command_seconds_count{op=\"get\"} 2"),
            "{text}"
        );
    }
}

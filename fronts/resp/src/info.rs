//! `INFO`: Redis's sections (`field:value` lines under `# Section`), filled
//! with the front's and the pool's figures, plus a `# Pool` section.

use std::fmt::Write;
use std::sync::atomic::Ordering;

use kvpool_wire::proto::PoolStat;

use crate::commands::SPECS;
use crate::ThreadCtx;

/// The Redis version whose protocol and replies the front follows (what
/// `HELLO` and `INFO` report as `redis_version`; clients use it to pick
/// features). kvpool's own is `kvpool_version`.
pub(crate) const REDIS_VERSION: &str = "7.0.0";

/// Sections in `INFO`'s order; `default` leaves out `commandstats`.
const SECTIONS: &[&str] = &[
    "server",
    "clients",
    "memory",
    "stats",
    "replication",
    "pool",
    "commandstats",
    "keyspace",
];

fn wanted(args: &[&[u8]]) -> Vec<&'static str> {
    if args.is_empty() {
        return SECTIONS
            .iter()
            .copied()
            .filter(|s| *s != "commandstats")
            .collect();
    }
    let has = |name: &str| args.iter().any(|a| a.eq_ignore_ascii_case(name.as_bytes()));
    if has("all") || has("everything") {
        return SECTIONS.to_vec();
    }
    let default = has("default");
    SECTIONS
        .iter()
        .copied()
        .filter(|s| has(s) || (default && *s != "commandstats"))
        .collect()
}

/// The text of `INFO [section ...]`. Asks the master for the pool's
/// figures only when a section shows them.
pub(crate) async fn render(ctx: &ThreadCtx, args: &[&[u8]]) -> String {
    let sections = wanted(args);
    let needs_pool = sections
        .iter()
        .any(|s| matches!(*s, "memory" | "stats" | "pool" | "keyspace"));
    let stat: Option<Result<PoolStat, String>> = if needs_pool {
        Some(ctx.client.stat().await.map_err(|e| e.to_string()))
    } else {
        None
    };
    let pool = stat.as_ref().and_then(|s| s.as_ref().ok());
    let shared = &ctx.shared;
    let m = &shared.metrics;
    let mut t = String::new();
    for (i, s) in sections.iter().enumerate() {
        if i > 0 {
            t.push_str("\r\n");
        }
        // Writing to a String cannot fail.
        let _ = match *s {
            "server" => write!(
                t,
                "# Server\r\nredis_version:{REDIS_VERSION}\r\nkvpool_version:{}\r\nredis_mode:standalone\r\n\
                 os:{}\r\narch_bits:{}\r\nprocess_id:{}\r\ntcp_port:{}\r\nuptime_in_seconds:{}\r\n\
                 uptime_in_days:{}\r\nresp_threads:{}\r\n",
                env!("CARGO_PKG_VERSION"),
                std::env::consts::OS,
                usize::BITS,
                std::process::id(),
                shared.port,
                shared.started.elapsed().as_secs(),
                shared.started.elapsed().as_secs() / 86_400,
                shared.threads,
            ),
            "clients" => write!(
                t,
                "# Clients\r\nconnected_clients:{}\r\nmaxclients:{}\r\n",
                m.open.load(Ordering::Relaxed),
                shared.cfg.max_clients
            ),
            "memory" => write!(
                t,
                "# Memory\r\nused_memory:{}\r\nmaxmemory:{}\r\nmaxmemory_policy:allkeys-lru\r\n\
                 resp_buffer_bytes:{}\r\nresp_max_buffer_bytes:{}\r\n\
                 resp_collection_keys:{}\r\nresp_collection_bytes:{}\r\n\
                 resp_max_collection_bytes:{}\r\n",
                pool.map_or(0, |p| p.used),
                pool.map_or(0, |p| p.capacity),
                shared.budget.used(),
                shared.cfg.max_buffer_memory.get(),
                shared.collections.len(),
                shared.collections.bytes(),
                shared.cfg.max_collection_memory.get(),
            ),
            "stats" => {
                let processed: u64 =
                    (0..SPECS.len()).map(|i| m.cmd(i).calls()).sum::<u64>() + m.unknown_calls();
                let errors: u64 =
                    (0..SPECS.len()).map(|i| m.cmd(i).errors()).sum::<u64>() + m.unknown_calls();
                write!(
                    t,
                    "# Stats\r\ntotal_connections_received:{}\r\ntotal_commands_processed:{processed}\r\n\
                     rejected_connections:{}\r\ntotal_error_replies:{errors}\r\nevicted_keys:{}\r\n\
                     protocol_errors:{}\r\nauth_failures:{}\r\n",
                    m.connections_total.get(),
                    m.rejected_connections.get(),
                    pool.map_or(0, |p| p.evictions),
                    m.protocol_errors.get(),
                    m.auth_failures.get(),
                )
            }
            "replication" => write!(t, "# Replication\r\nrole:master\r\nconnected_slaves:0\r\n"),
            "pool" => match &stat {
                Some(Ok(p)) => write!(
                    t,
                    "# Pool\r\npool_keys:{}\r\npool_segments:{}\r\npool_capacity_bytes:{}\r\n\
                     pool_used_bytes:{}\r\npool_evictions:{}\r\npool_evicted_bytes:{}\r\n\
                     pool_demotions:{}\r\npool_promotions:{}\r\npool_hot_copies:{}\r\n",
                    p.keys,
                    p.segments.len(),
                    p.capacity,
                    p.used,
                    p.evictions,
                    p.evicted_bytes,
                    p.demotions,
                    p.promotions,
                    p.hot_copies,
                ),
                Some(Err(e)) => write!(
                    t,
                    "# Pool\r\npool_error:{}\r\n",
                    e.replace(['\r', '\n'], " ")
                ),
                None => Ok(()),
            },
            "commandstats" => {
                let _ = t.write_str("# Commandstats\r\n");
                for (i, s) in SPECS.iter().enumerate() {
                    let c = m.cmd(i);
                    let calls = c.calls();
                    if calls == 0 {
                        continue;
                    }
                    let _ = write!(
                        t,
                        "cmdstat_{}:calls={calls},usec={},usec_per_call={:.2},rejected_calls=0,failed_calls={}\r\n",
                        s.name,
                        c.usec(),
                        c.usec() as f64 / calls as f64,
                        c.errors(),
                    );
                }
                Ok(())
            }
            "keyspace" => {
                let _ = t.write_str("# Keyspace\r\n");
                let keys = pool.map_or(0, |p| p.keys as usize) + shared.collections.len();
                if keys > 0 {
                    write!(t, "db0:keys={keys},expires=0,avg_ttl=0\r\n")
                } else {
                    Ok(())
                }
            }
            _ => Ok(()),
        };
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_are_picked_as_redis_picks_them() {
        assert!(!wanted(&[]).contains(&"commandstats"));
        assert!(wanted(&[]).contains(&"keyspace"));
        assert_eq!(wanted(&[b"ALL"]).len(), SECTIONS.len());
        assert_eq!(
            wanted(&[b"pool", b"Commandstats"]),
            vec!["pool", "commandstats"]
        );
        assert!(wanted(&[b"nosuch"]).is_empty());
    }
}

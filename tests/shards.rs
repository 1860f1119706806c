//! Shard layout (issue 28): the master holds its keys on the first
//! `master.shards` of the process's shards (4 when not set), and a client
//! keeps its TCP transfers to one shard of a storage node
//! (`client.shard_affinity`), so one client does not wake a different
//! parked core for every key.

use std::process::Command;
use std::time::Duration;

use crate::common;

/// `kvpool_storage_shard_requests_total` of each shard, by shard.
fn shard_requests(http: &str) -> std::collections::BTreeMap<u32, u64> {
    let (_, text) = common::http(http, "GET", "/metrics");
    let series: std::collections::BTreeMap<u32, u64> = text
        .lines()
        .filter_map(|l| l.strip_prefix("kvpool_storage_shard_requests_total{shard=\""))
        .filter_map(|l| {
            let (shard, rest) = l.split_once("\"}")?;
            Some((shard.parse().ok()?, rest.trim().parse().ok()?))
        })
        .collect();
    assert!(!series.is_empty(), "no per-shard series in:\n{text}");
    series
}

/// `kvpool bench transfer` over TCP with `config`: 64 values of 4 KiB put
/// and read back by one client.
fn bench_tcp(master: &str, config: &str) {
    let cfg = common::config_file("affinity", config);
    let (code, out, err) = common::run_command(
        Command::new(common::BIN)
            .env_remove("KVPOOL_SECRET")
            .args(["--config", &cfg, "--master", master, "bench", "transfer"])
            .args(["--transport", "tcp", "--sizes", "4KiB", "--batch", "1"])
            .args(["--max-calls", "64", "--json"]),
        None,
        Duration::from_secs(60),
    );
    assert_eq!(code, 0, "bench failed: {err}");
    let rows = String::from_utf8_lossy(&out).lines().count();
    assert_eq!(
        rows,
        2,
        "a put and a get row: {}",
        String::from_utf8_lossy(&out)
    );
}

/// Requests per shard that `run` added.
fn added(http: &str, run: impl FnOnce()) -> Vec<u64> {
    let before = shard_requests(http);
    run();
    let after = shard_requests(http);
    after
        .iter()
        .map(|(s, n)| n - before.get(s).copied().unwrap_or(0))
        .collect()
}

#[test]
fn a_client_with_shard_affinity_sends_every_transfer_to_one_node_shard() {
    let node = common::start("all", &common::ephemeral(&["--segment-size", "64MiB"]));
    // The bench's keys are spread over both master shards, and each master
    // shard places its values in its own range of the segment: half of the
    // offsets lie in each storage shard's slice.
    let spread = added(&node.http, || {
        bench_tcp(&node.addr, "[client]\nshard_affinity = false\n")
    });
    assert_eq!(spread.len(), 2, "{spread:?}");
    assert!(
        spread.iter().all(|&n| n >= 16),
        "by offset, both shards serve: {spread:?}"
    );
    // The default: one shard of the node serves all of one client's puts
    // and gets (64 + 64, and the warm-up value's two).
    let kept = added(&node.http, || bench_tcp(&node.addr, ""));
    let busy: Vec<_> = kept.iter().filter(|&&n| n > 0).collect();
    assert_eq!(busy.len(), 1, "one shard serves the client: {kept:?}");
    assert!(*busy[0] >= 128, "{kept:?}");
}

#[test]
fn the_master_holds_its_keys_on_four_shards_unless_told_and_refuses_more_than_it_has() {
    let args = [
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
        "--segment-size",
        "64MiB",
        "--shards",
        "6",
    ];
    let node = common::start("all", &args);
    let log = node.stderr();
    assert!(
        log.contains("master: keys on 4 of the process's 6 shards"),
        "{log}"
    );
    // Every key has a master shard that answers.
    bench_tcp(&node.addr, "");
    drop(node);

    let cfg = common::config_file("master-shards", "[master]\nshards = 7\n");
    let (code, _, err) = common::run_command(
        Command::new(common::BIN)
            .env_remove("KVPOOL_SECRET")
            .args(["run", "--role", "all", "--no-serving", "--config", &cfg])
            .args(args),
        None,
        Duration::from_secs(30),
    );
    assert_ne!(
        code, 0,
        "a master with more shards than the process started"
    );
    assert!(
        err.contains("master.shards") && err.contains("7 is more than the process's 6 shards"),
        "{err}"
    );
}

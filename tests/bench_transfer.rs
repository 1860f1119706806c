//! `kvpool bench transfer` against a real `kvpool run`: every row on a pool
//! whose removed values keep their space (read leases longer than the run),
//! and a failing case named after the rows before it.

use crate::common;

use std::time::Duration;

/// `kvpool run` with a 64 MiB pool whose read leases outlast the test: the
/// space of every value the bench reads and removes stays held until the
/// end. Returns the node and its config file (the bench reads it too).
fn start_pool(name: &str) -> (common::Proc, String) {
    let dir = common::scratch_dir(name);
    let cfg = common::write_config(
        &dir,
        "long-leases.toml",
        "[master]\nlease_ttl_ms = 600000\n",
    );
    let mut args = common::ephemeral(&["--segment-size", "64MiB"]);
    args.extend(["--config", cfg.as_str()]);
    (common::start("all", &args), cfg)
}

/// The bench left no key behind, failed or not.
fn assert_no_keys(master: &str) {
    let (_, out, _) = common::cli(master, &["stat", "--json"], None);
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["keys"], 0, "{v}");
}

fn bench(master: &str, cfg: &str, args: &[&str]) -> (i32, Vec<serde_json::Value>, String) {
    let mut a = vec!["--config", cfg, "bench", "transfer", "--json"];
    a.extend_from_slice(args);
    let child = std::process::Command::new(common::BIN)
        .env_remove("KVPOOL_SECRET")
        .env("RUST_LOG", "info")
        .arg("--master")
        .arg(master)
        .args(&a)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn kvpool bench");
    let out = common::wait_output(child, Duration::from_secs(120));
    let rows = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    (
        out.status.code().unwrap_or(-1),
        rows,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bench_transfer_completes_every_row_when_no_read_lease_ends_during_the_run() {
    let (node, cfg) = start_pool("bench-every-row");
    // Asked for, the 12 cases would put 16 MiB each: three times the pool.
    let (code, rows, err) = bench(
        &node.addr,
        &cfg,
        &[
            "--transport",
            "tcp,shm,auto",
            "--sizes",
            "64KiB,1MiB",
            "--batch",
            "1,32",
            "--bytes",
            "16MiB",
            "--max-calls",
            "256",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(rows.len(), 24, "{rows:?}\n{err}");
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r["op"], if i % 2 == 0 { "put" } else { "get" }, "{r}");
        assert!(r["calls"].as_u64().unwrap() >= 1, "{r}");
        // `auto` says which path it took: shm, the node being on this host.
        let want = match r["transport"].as_str().unwrap() {
            "tcp" => "tcp",
            "shm" | "auto" => "shm",
            t => panic!("transport {t}"),
        };
        assert_eq!(r["path"], want, "{r}");
    }
    // One progress line per case, on stderr, plain text.
    for i in 1..=12 {
        assert!(err.contains(&format!("bench: case {i}/12 (")), "{err}");
    }
    assert!(!err.contains('\x1b'), "{err:?}");
    assert_no_keys(&node.addr);
}

#[test]
fn bench_transfer_names_the_failing_case_after_printing_the_rows_before_it() {
    let (node, cfg) = start_pool("bench-fails");
    // A 64 MiB value cannot fit in a 64 MiB pool below its watermark.
    let (code, rows, err) = bench(
        &node.addr,
        &cfg,
        &[
            "--transport",
            "tcp",
            "--sizes",
            "4KiB,64MiB",
            "--batch",
            "1",
            "--max-calls",
            "20",
        ],
    );
    assert_eq!(code, 2, "{err}");
    assert_eq!(rows.len(), 2, "the first case's rows: {rows:?}\n{err}");
    assert_eq!(rows[0]["size"], 4096);
    assert!(
        err.contains("error: NoSpace (")
            && err.contains("case 2/2 (tcp 64MiB batch 1)")
            && err.contains("2 rows measured before it"),
        "{err}"
    );
    assert_no_keys(&node.addr);
}

#[test]
fn benches_run_at_once_against_one_pool_each_with_several_clients_and_none_collides() {
    // Leases of the default length: each bench's space comes back to the
    // others as it goes.
    let node = common::start("all", &common::ephemeral(&["--segment-size", "256MiB"]));
    let cfg = common::write_config(&common::scratch_dir("bench-at-once"), "default.toml", "");
    let args = [
        "--transport",
        "tcp",
        "--sizes",
        "4KiB,64KiB",
        "--batch",
        "1,32",
        "--clients",
        "1,3",
        "--bytes",
        "4MiB",
        "--max-calls",
        "64",
    ];
    // Three processes at once, as a cluster's clients are (every bench used
    // to warm up on one key, `bench/warm`: the others failed at once).
    let runs: Vec<_> = (0..3)
        .map(|_| {
            let (addr, cfg) = (node.addr.clone(), cfg.clone());
            std::thread::spawn(move || bench(&addr, &cfg, &args))
        })
        .collect();
    for run in runs {
        let (code, rows, err) = run.join().unwrap();
        assert_eq!(code, 0, "{err}");
        assert_eq!(rows.len(), 16, "{rows:?}\n{err}");
        for r in &rows {
            let clients = r["clients"].as_u64().unwrap();
            assert!(clients == 1 || clients == 3, "{r}");
            // Every client made calls: a case deals one value or more to each.
            assert!(r["calls"].as_u64().unwrap() >= clients, "{r}");
        }
        assert!(err.contains("batch 32, 3 clients)"), "{err}");
    }
    assert_no_keys(&node.addr);
}

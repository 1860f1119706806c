//! The CLI against a real `kvpool run` (role all), and the process lifecycle.

mod common;

use std::time::Duration;

use common::Signal;

#[test]
fn cli_puts_gets_checks_removes_and_reports_against_role_all() {
    let dir = std::env::temp_dir().join(format!("kvpool-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Leases that outlive the test: the end checks that a forced removal's
    // space waits for its readers' leases, which the default 10 s TTL does
    // not guarantee on a slow machine (the emulated RDMA guest).
    let cfg = dir.join("long-leases.toml");
    std::fs::write(&cfg, "[master]\nlease_ttl_ms = 600000\n").unwrap();
    let mut args = common::ephemeral(&["--segment-size", "64MiB"]);
    args.extend(["--config", cfg.to_str().unwrap()]);
    let node = common::start("all", &args);
    let m = node.addr.as_str();

    // put from a file, get to stdout
    let input = dir.join("in.bin");
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&input, &data).unwrap();
    let (code, _, err) = common::cli(m, &["put", "from-file", input.to_str().unwrap()], None);
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = common::cli(m, &["get", "from-file"], None);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, data);

    // put from stdin (implicit and `-`), get to a file
    let (code, _, err) = common::cli(m, &["put", "from-stdin"], Some(b"hello kvpool"));
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = common::cli(m, &["put", "dash", "-"], Some(b"dash"));
    assert_eq!(code, 0, "{err}");
    let out_file = dir.join("out.bin");
    let (code, _, err) = common::cli(
        m,
        &["get", "from-stdin", "-o", out_file.to_str().unwrap()],
        None,
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(std::fs::read(&out_file).unwrap(), b"hello kvpool");

    // exists: 0 when present, 1 when not
    assert_eq!(common::cli(m, &["exists", "dash"], None).0, 0);
    assert_eq!(common::cli(m, &["exists", "nope"], None).0, 1);

    // a second put of a key is refused with its code
    let (code, _, err) = common::cli(m, &["put", "dash"], Some(b"again"));
    assert_eq!(code, 2);
    assert!(err.contains("ObjectAlreadyExists"), "{err}");
    // --replace replaces it (seen through the admin route, which grants no
    // lease: the plain rm below still takes it)
    let (code, _, err) = common::cli(m, &["put", "--replace", "dash"], Some(b"again"));
    assert_eq!(code, 0, "{err}");
    let (status, body) = common::http(&node.http, "GET", "/api/v1/keys/dash");
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["size"], 5, "{v}");

    // stat, text and JSON
    let (code, out, _) = common::cli(m, &["stat"], None);
    assert_eq!(code, 0);
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("segments: 1"), "{text}");
    assert!(text.contains("keys: 3"), "{text}");
    let (code, out, _) = common::cli(m, &["stat", "--json"], None);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["keys"], 3);
    assert_eq!(v["capacity"], 64 << 20);
    assert!(v["used"].as_u64().unwrap() >= 300_000);

    // rm, then the key is gone; a key just read is leased: rm refuses it
    // until --force; rm of a missing key is an error with its code
    let (code, _, err) = common::cli(m, &["rm", "from-file"], None);
    assert_eq!(code, 2);
    assert!(err.contains("ObjectHasLease (5)"), "{err}");
    for k in ["from-file", "from-stdin"] {
        let (code, _, err) = common::cli(m, &["rm", "--force", k], None);
        assert_eq!(code, 0, "{err}");
    }
    let (code, _, err) = common::cli(m, &["rm", "dash"], None);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = common::cli(m, &["get", "dash"], None);
    assert_eq!(code, 2);
    assert!(err.contains("ObjectNotFound (2)"), "{err}");
    let (code, _, err) = common::cli(m, &["rm", "dash"], None);
    assert_eq!(code, 2);
    assert!(err.contains("ObjectNotFound"), "{err}");
    let (_, out, _) = common::cli(m, &["stat", "--json"], None);
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["keys"], 0);
    // The two forced removals were leased: their space (rounded to 64 B)
    // comes back only when the readers' leases end.
    assert_eq!(v["used"], 300_032 + 64);

    // an unreachable master is a clear error, not a hang
    let (code, _, err) = common::cli("127.0.0.1:1", &["stat"], None);
    assert_eq!(code, 2);
    assert!(err.contains("Unavailable"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigterm_stops_a_node_with_exit_code_zero_and_closes_its_ports() {
    let mut node = common::start("all", &common::ephemeral(&["--segment-size", "64MiB"]));
    let (code, _, err) = common::cli(&node.addr, &["put", "k"], Some(b"v"));
    assert_eq!(code, 0, "{err}");
    node.signal(Signal::TERM);
    let st = node
        .wait_exit(Duration::from_secs(10))
        .expect("the node exits after SIGTERM");
    assert_eq!(st.code(), Some(0), "stderr:\n{}", node.stderr());
    assert!(
        node.stderr().contains("segment unmounted"),
        "{}",
        node.stderr()
    );
    assert!(
        std::net::TcpStream::connect(&node.addr).is_err(),
        "the port is closed"
    );
}

#[test]
fn a_config_typo_stops_start_up_with_an_error_naming_the_key() {
    let dir = std::env::temp_dir().join(format!("kvpool-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("typo.toml");
    std::fs::write(&cfg, "[storage]\nsegment_sise = \"1 GiB\"\n").unwrap();
    let child = std::process::Command::new(common::BIN)
        .args(["run", "--config", cfg.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = common::wait_output(child, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("segment_sise"), "{err}");

    std::fs::write(
        &cfg,
        "[master]\nlease_ttl_ms = \"ten\"\n[runtime]\nshards = -1\n",
    )
    .unwrap();
    let child = std::process::Command::new(common::BIN)
        .args(["run", "--config", cfg.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = common::wait_output(child, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(2));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every process config in configs/ (all but the simulator's cost model).
fn process_configs() -> Vec<(String, String)> {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut v: Vec<(String, String)> = std::fs::read_dir(format!("{root}/configs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        // Cluster cost models (cluster-model*.toml) are the simulator's, not
        // a process's.
        .filter(|p| {
            !p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("cluster-model"))
        })
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            (p.display().to_string(), text)
        })
        .collect();
    v.sort();
    assert!(v.len() >= 5, "configs/ lost files: {v:?}");
    v
}

#[test]
fn the_example_configs_parse() {
    for (path, text) in process_configs() {
        kvpool_config::NodeConfig::from_toml(&text, &path)
            .unwrap_or_else(|e| panic!("{path}: {e}"));
    }
}

/// The configs README's "Several machines" starts masters with keep a state
/// directory, so a restarted master remembers its objects by default.
#[test]
fn the_production_master_configs_keep_a_state_directory() {
    for name in ["master.toml", "ha-master.toml"] {
        let path = format!("{}/configs/{name}", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).unwrap();
        let c = kvpool_config::NodeConfig::from_toml(&text, &path).unwrap();
        assert!(
            !c.master.state_dir.is_empty(),
            "{path}: [master] state_dir is empty: a restarted master forgets its objects"
        );
    }
}

/// `--role` takes the one list of roles (`kvpool_config::Role`): `--help`
/// names every role, and an unknown one is refused with exit 2 and that
/// list, before anything starts.
#[test]
fn run_role_takes_every_role_and_refuses_others_naming_them() {
    let run = |args: &[&str]| bin_output(args, Duration::from_secs(30));
    let roles = [
        "all",
        "master",
        "storage",
        "gateway",
        "engine",
        "conductor",
        "prefill-proxy",
        "decode-proxy",
    ];
    let help = run(&["run", "--help"]);
    assert!(help.status.success());
    let help = String::from_utf8(help.stdout).unwrap();
    for role in roles {
        assert!(
            help.contains(role),
            "--help does not name role {role}:\n{help}"
        );
    }
    let out = run(&["run", "--role", "prefill"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("prefill"), "{err}");
    for role in roles {
        assert!(
            err.contains(role),
            "the error does not name role {role}: {err}"
        );
    }
}

/// `kvpool run --help` describes each flag with its own text (`--resp` once
/// carried `--model`'s).
#[test]
fn run_help_describes_resp_as_the_redis_front() {
    let out = bin_output(&["run", "--help"], Duration::from_secs(30));
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    // One flag's lines: its own, then its description's, up to the next flag.
    let flag = |name: &str| -> String {
        let mut lines = help
            .lines()
            .skip_while(|l| !l.trim_start().starts_with(&format!("--{name} ")));
        let head = lines
            .next()
            .unwrap_or_else(|| panic!("no --{name} in:\n{help}"));
        let body: Vec<&str> = lines
            .take_while(|l| !l.trim_start().starts_with('-'))
            .collect();
        format!("{head}\n{}", body.join("\n"))
    };
    let resp = flag("resp");
    assert!(resp.contains("Redis"), "--resp: {resp}");
    assert!(!resp.contains("Hugging Face"), "--resp: {resp}");
    let model = flag("model");
    assert!(model.contains("Hugging Face"), "--model: {model}");
}

#[test]
fn an_unknown_key_in_any_section_of_the_example_configs_is_named() {
    for (path, text) in process_configs() {
        let sections: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with('[') && l.ends_with(']'))
            .collect();
        assert!(!sections.is_empty(), "{path} has no section");
        for section in sections {
            let bad = text.replacen(
                &format!("{section}\n"),
                &format!("{section}\nno_such_key_here = 1\n"),
                1,
            );
            let e = kvpool_config::NodeConfig::from_toml(&bad, &path)
                .expect_err(&format!("{path} {section}: an unknown key was accepted"));
            assert!(
                e.to_string().contains("no_such_key_here"),
                "{path} {section}: {e}"
            );
        }
    }
}

#[test]
fn sim_prints_one_json_object_per_policy_and_cache_capacity() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/synthetic_trace.jsonl"
    );
    let run = |args: &[&str]| {
        let out = bin_output(args, Duration::from_secs(60));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .collect::<Vec<_>>()
    };
    let rows = run(&[
        "sim",
        "--trace",
        trace,
        "--policy",
        "cache_global,early_reject",
        "--json",
        "--no-progress",
    ]);
    assert_eq!(rows.len(), 2);
    for (row, policy) in rows.iter().zip(["cache_global", "early_reject"]) {
        assert_eq!(row["policy"], policy);
        for k in [
            "prefix_hit_ratio",
            "ttft_ms_p50",
            "ttft_ms_p90",
            "ttft_ms_p99",
            "tbt_ms_p50",
            "tbt_ms_p90",
            "tbt_ms_p99",
            "slo_attainment",
            "goodput_rps",
            "rejected",
        ] {
            assert!(row[k].is_number(), "{k} missing in {row}");
        }
    }
    let rows = run(&[
        "sim",
        "cache",
        "--trace",
        trace,
        "--cache-policy",
        "lru",
        "--cache-blocks",
        "1000,inf",
        "--json",
    ]);
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["cache_policy"], "lru");
    assert_eq!(rows[0]["cache_blocks"], 1000);
    let r = rows[0]["prefix_hit_ratio"].as_f64().unwrap();
    assert!((r - 0.0825).abs() <= 0.0005, "{r}");
    assert_eq!(rows[1]["cache_blocks"], "inf");
}

#[test]
fn single_node_toml_spells_out_every_default() {
    let root = env!("CARGO_MANIFEST_DIR");
    let path = format!("{root}/configs/single-node.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let from_file = kvpool_config::NodeConfig::from_toml(&text, &path).unwrap();
    let defaults = kvpool_config::NodeConfig::default();
    // Same values, and every key present (so each is documented there).
    let a = serde_json::to_value(&from_file).unwrap();
    let b = serde_json::to_value(&defaults).unwrap();
    assert_eq!(
        a, b,
        "configs/single-node.toml differs from the embedded defaults"
    );
    for (section, keys) in b.as_object().unwrap() {
        for (key, v) in keys.as_object().unwrap() {
            if let Some(sub) = v.as_object() {
                // A nested table, e.g. [storage.nvme].
                assert!(
                    text.contains(&format!("[{section}.{key}]")),
                    "[{section}.{key}] missing"
                );
                for k in sub.keys() {
                    assert!(
                        text.lines()
                            .any(|l| l.trim_start().starts_with(&format!("{k} ="))),
                        "{section}.{key}.{k} is not in configs/single-node.toml"
                    );
                }
                continue;
            }
            assert!(
                text.lines()
                    .any(|l| l.trim_start().starts_with(&format!("{key} ="))),
                "{section}.{key} is not in configs/single-node.toml"
            );
        }
    }
}

#[test]
fn rdma_required_but_unavailable_stops_a_storage_node_at_start_up() {
    // Built without the rdma feature, or with it but without this device:
    // either way `required` is an error, never a silent fall back to tcp.
    let dir = std::env::temp_dir().join(format!("kvpool-rdma-req-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("rdma.toml");
    std::fs::write(
        &cfg,
        "[storage]\nsegment_size = \"16 MiB\"\nlisten = \"127.0.0.1:0\"\nhttp = \"127.0.0.1:0\"\n\
         [master]\nlisten = \"127.0.0.1:0\"\nhttp = \"127.0.0.1:0\"\n\
         [storage.rdma]\nenabled = \"required\"\ndevices = [\"no_such_rdma_dev\"]\n",
    )
    .unwrap();
    let child = std::process::Command::new(common::BIN)
        .args(["run", "--config", cfg.to_str().unwrap(), "--shards", "1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = common::wait_output(child, Duration::from_secs(30));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("rdma is required but"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[cfg(not(feature = "rdma"))]
fn bench_transfer_refuses_rdma_in_a_build_without_the_feature_before_connecting() {
    // No master at this address: the answer must come before any connect.
    let (code, out, err) = common::cli(
        "127.0.0.1:1",
        &["bench", "transfer", "--transport", "tcp,rdma"],
        None,
    );
    assert_eq!(code, 2, "{err}");
    assert!(out.is_empty(), "{}", String::from_utf8_lossy(&out));
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("error: Unsupported (")
            && err.contains("--transport rdma")
            && err.contains("--features rdma"),
        "{err}"
    );
}

#[test]
fn logs_written_to_a_file_or_a_pipe_carry_no_colour_codes() {
    // The node's stderr is a file, the CLI's a pipe.
    let node = common::start("all", &common::ephemeral(&["--segment-size", "16MiB"]));
    let (code, _, err) = common::cli_env(&node.addr, &["stat"], None, &[("RUST_LOG", "debug")]);
    assert_eq!(code, 0, "{err}");
    assert!(!err.is_empty(), "the CLI logs something at debug");
    assert!(!err.contains('\x1b'), "{err:?}");
    let log = node.stderr();
    assert!(log.contains("segment mounted"), "{log}");
    assert!(!log.contains('\x1b'), "{log:?}");
}

#[test]
fn a_cli_command_does_not_log_that_it_has_no_rdma() {
    let node = common::start("all", &common::ephemeral(&["--segment-size", "16MiB"]));
    let (code, _, err) = common::cli(&node.addr, &["stat"], None);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("no rdma"), "{err}");
    // The node still says once whether it serves RDMA, and why not.
    let log = node.stderr();
    assert!(
        log.contains("no rdma") || log.contains("rdma devices opened"),
        "{log}"
    );
}

/// The binary run with `args`, its output once it ends (within `within`).
fn bin_output(args: &[&str], within: Duration) -> std::process::Output {
    let child = std::process::Command::new(common::BIN)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    common::wait_output(child, within)
}

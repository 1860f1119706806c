//! Batches through the client library, the admin HTTP API and the CLI's
//! pin and force flags, against a real `kvpool run`.

use crate::common;

use kvpool_client::Client;
use kvpool_config::ClientConfig;
use kvpool_wire::proto::PutOptions;
use kvpool_wire::ErrorCode;

#[test]
fn batch_calls_return_one_result_per_key_in_order() {
    let node = common::start("all", &common::ephemeral(&["--segment-size", "64MiB"]));
    let rt = common::rt();
    rt.block_on(async {
        let c = Client::connect(&node.addr, ClientConfig::default())
            .await
            .unwrap();
        c.put(b"taken", b"x").await.unwrap();
        let keys: Vec<Vec<u8>> = (0..50).map(|i| format!("batch-{i}").into_bytes()).collect();
        let vals: Vec<Vec<u8>> = (0..50).map(|i| vec![i as u8; 100 + i * 37]).collect();
        let mut items: Vec<(&[u8], &[u8])> = keys
            .iter()
            .zip(&vals)
            .map(|(k, v)| (k.as_slice(), v.as_slice()))
            .collect();
        items.insert(10, (b"taken", b"again"));
        items.insert(20, (b"", b"empty key"));
        let r = c.batch_put(&items, &PutOptions::default()).await.unwrap();
        assert_eq!(r.len(), 52);
        assert_eq!(
            r[10].as_ref().unwrap_err().code,
            ErrorCode::ObjectAlreadyExists
        );
        assert_eq!(r[20].as_ref().unwrap_err().code, ErrorCode::InvalidParams);
        assert_eq!(r.iter().filter(|x| x.is_ok()).count(), 50);

        let mut ks: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        ks.insert(5, b"missing");
        let got = c.batch_get(&ks).await.unwrap();
        assert_eq!(got[5].as_ref().unwrap_err().code, ErrorCode::ObjectNotFound);
        let values: Vec<&Vec<u8>> = got.iter().filter_map(|g| g.as_ref().ok()).collect();
        assert_eq!(values.len(), 50);
        for (v, want) in values.iter().zip(&vals) {
            assert_eq!(*v, want, "values come back in key order");
        }
        let ex = c.batch_exists(&ks).await.unwrap();
        assert!(!*ex[5].as_ref().unwrap());
        assert!(ex
            .iter()
            .enumerate()
            .all(|(i, e)| i == 5 || *e.as_ref().unwrap()));
        // Leased by the batch_get just above: refused without force.
        let rm = c.batch_remove(&ks, false).await.unwrap();
        assert_eq!(rm[0].as_ref().unwrap_err().code, ErrorCode::ObjectHasLease);
        let rm = c.batch_remove(&ks, true).await.unwrap();
        assert_eq!(rm[5].as_ref().unwrap_err().code, ErrorCode::ObjectNotFound);
        assert_eq!(rm.iter().filter(|r| r.is_ok()).count(), 50);
        assert_eq!(c.stat().await.unwrap().keys, 1);
    });
}

#[test]
fn admin_http_describes_keys_lists_segments_and_removes_all() {
    let node = common::start("all", &common::ephemeral(&["--segment-size", "64MiB"]));
    let m = node.addr.as_str();
    let (code, _, err) = common::cli(
        m,
        &["put", "pinned", "--hard-pin", "--soft-pin-ms", "60000"],
        Some(b"v"),
    );
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = common::cli(m, &["put", "two", "--replicas", "2"], Some(b"vv"));
    assert_eq!(code, 0, "{err}");

    let (status, body) = common::http(&node.http, "GET", "/api/v1/keys/pinned");
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["state"], "complete");
    assert_eq!(v["size"], 1);
    assert_eq!(v["hard_pin"], true);
    assert!(v["soft_pin_remaining_ms"].as_u64().unwrap() > 50_000);
    assert_eq!(v["replicas"].as_array().unwrap().len(), 1);
    assert_eq!(v["replicas"][0]["tier"], "dram");

    let (status, body) = common::http(&node.http, "GET", "/api/v1/keys/nope");
    assert_eq!(status, 404);
    assert!(body.contains("ObjectNotFound"), "{body}");

    let (status, body) = common::http(&node.http, "GET", "/api/v1/segments");
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["segments"].as_array().unwrap().len(), 1);
    assert_eq!(v["keys"], 2);
    assert_eq!(v["segments"][0]["capacity"], 64 << 20);
    // Mooncake's route (SGLang's check_server): the names, one per line.
    let (status, names) = common::http(&node.http, "GET", "/get_all_segments");
    assert_eq!(status, 200);
    assert_eq!(
        names,
        format!("{}\n", v["segments"][0]["name"].as_str().unwrap())
    );

    // A get leases "two": remove_all leaves it, rm refuses it, rm --force works.
    let (code, _, _) = common::cli(m, &["get", "two"], None);
    assert_eq!(code, 0);
    let (status, body) = common::http(&node.http, "POST", "/api/v1/remove_all");
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["removed"],
        1
    );
    let (code, _, err) = common::cli(m, &["rm", "two"], None);
    assert_eq!(code, 2);
    assert!(err.contains("ObjectHasLease"), "{err}");
    let (code, _, err) = common::cli(m, &["rm", "two", "--force"], None);
    assert_eq!(code, 0, "{err}");

    let (status, body) = common::http(&node.http, "GET", "/healthz");
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    let (status, body) = common::http(&node.http, "GET", "/metrics");
    assert_eq!(status, 200);
    for name in [
        "kvpool_master_keys",
        "kvpool_master_segment_capacity_bytes",
        "kvpool_master_segment_used_bytes",
        "kvpool_master_evictions",
        "kvpool_master_evicted_bytes",
        "kvpool_master_calls_total",
        "kvpool_master_call_seconds_bucket",
        "kvpool_storage_requests_total",
        "kvpool_storage_segment_bytes",
    ] {
        assert!(body.contains(name), "{name} missing from /metrics");
    }
}

/// A put asking for more replicas than there are nodes with room is
/// acknowledged, and said: a metric, and a warning in the master's log.
#[test]
fn a_put_with_fewer_replicas_than_asked_is_counted_and_logged() {
    let node = common::start("all", &common::ephemeral(&[]));
    let m = &node.addr;
    let (code, _, err) = common::cli(m, &["put", "two", "--replicas", "2"], Some(b"v"));
    assert_eq!(code, 0, "acknowledged with the one node there is: {err}");
    let (code, _, err) = common::cli(m, &["put", "one"], Some(b"v"));
    assert_eq!(code, 0, "{err}");
    let want = "kvpool_master_puts_fewer_replicas_total 1\n";
    common::eventually_blocking(
        "the count in /metrics (the tick reports it within a second)",
        std::time::Duration::from_secs(5),
        || {
            let (_, body) = common::http(&node.http, "GET", "/metrics");
            if body.contains(want) {
                Ok(())
            } else {
                Err(format!("{want:?} not in:\n{body}"))
            }
        },
    );
    assert!(
        node.stderr()
            .contains("puts acknowledged with fewer replicas than they asked for"),
        "{}",
        node.stderr()
    );
}

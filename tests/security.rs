//! The cluster secret through real processes: the roles of a cluster with a
//! secret work together (client library, CLI, shm and TCP data paths), and
//! the raw frames and HTTP calls that any peer could send to an open cluster
//! (remove everything, mount a fake segment, unmount a live node, forge NVMe
//! reports, write into a node's memory, map its segment) are refused and
//! logged. An open cluster that listens beyond loopback says so loudly.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use kvpool_client::Client;
use kvpool_config::{ClientConfig, Secret, Transport};
use kvpool_wire::auth::{self, ClusterKey, Grant};
use kvpool_wire::frame::FrameKind;
use kvpool_wire::proto::{
    DataRequest, DataResponse, Endpoint, MasterRequest, MasterResponse, NvmeUpdate, ReplicaDesc,
    SegmentSpec, Tier,
};
use kvpool_wire::ErrorCode;

const SECRET: &str = "a-test-cluster-secret-0123456789";

fn cfg_file(name: &str, text: &str) -> String {
    let dir = std::env::temp_dir().join(format!("kvpool-security-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

fn client_cfg(secret: &str, transport: Transport) -> ClientConfig {
    ClientConfig {
        secret: Secret::new(secret),
        transport,
        timeout_ms: 5_000,
        ..Default::default()
    }
}

/// A master (secret from the environment) and a storage node (secret from
/// its config file), in two processes.
fn secured_cluster() -> (common::Proc, common::Proc) {
    let master = common::start_env(
        "master",
        &common::ephemeral(&[]),
        &[("KVPOOL_SECRET", SECRET)],
    );
    let scfg = cfg_file(
        "storage.toml",
        &format!("[security]\nsecret = \"{SECRET}\"\n"),
    );
    let storage = common::start_storage(&master.addr, "64MiB", &["--config", &scfg]);
    (master, storage)
}

fn connect(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// One master request on a fresh, unauthenticated connection.
fn raw_master(addr: &str, req: &MasterRequest) -> Result<MasterResponse, ErrorCode> {
    common::exchange(&mut connect(addr), FrameKind::MasterRequest, 9, req, &[])
}

/// A connection that proved it holds `secret` (as client `id`).
fn authenticated(addr: &str, secret: &str, id: u64) -> TcpStream {
    let key = ClusterKey::new(secret.as_bytes()).unwrap();
    let mut s = connect(addr);
    let nc = auth::nonce();
    let ns = match common::exchange(
        &mut s,
        FrameKind::MasterRequest,
        1,
        &MasterRequest::AuthBegin {
            client_id: id,
            nonce: nc,
        },
        &[],
    ) {
        Ok(MasterResponse::AuthChallenge { nonce }) => nonce,
        other => panic!("AuthBegin: {other:?}"),
    };
    let proof = key.client_proof(id, &nc, &ns);
    match common::exchange(
        &mut s,
        FrameKind::MasterRequest,
        2,
        &MasterRequest::AuthProve { proof },
        &[],
    ) {
        Ok(MasterResponse::AuthOk { proof }) => {
            key.verify_server_proof(id, &nc, &ns, &proof).unwrap()
        }
        other => panic!("AuthProve: {other:?}"),
    }
    s
}

/// A data connection to a storage node that proved it holds `secret`.
fn data_authenticated(addr: &str, secret: &str) -> TcpStream {
    let key = ClusterKey::new(secret.as_bytes()).unwrap();
    let mut s = connect(addr);
    let nc = auth::nonce();
    let ns = match common::exchange(
        &mut s,
        FrameKind::DataRequest,
        1,
        &DataRequest::AuthBegin {
            client_id: 0,
            nonce: nc,
        },
        &[],
    ) {
        Ok(DataResponse::AuthChallenge { nonce }) => nonce,
        other => panic!("data AuthBegin: {other:?}"),
    };
    let proof = key.data_client_proof(0, &nc, &ns);
    match common::exchange(
        &mut s,
        FrameKind::DataRequest,
        2,
        &DataRequest::AuthProve { proof },
        &[],
    ) {
        Ok(DataResponse::AuthOk { proof }) => {
            key.verify_data_server_proof(0, &nc, &ns, &proof).unwrap()
        }
        other => panic!("data AuthProve: {other:?}"),
    }
    s
}

fn fake_spec() -> SegmentSpec {
    SegmentSpec {
        name: "attacker:1:fake".into(),
        size: 1 << 40,
        endpoint: Endpoint {
            host: "127.0.0.1".into(),
            port: 1,
            nr_shards: 1,
        },
        slice_bytes: 1 << 40,
        host_id: "attacker".into(),
        tier: Tier::Dram,
        nvme: None,
    }
}

#[test]
fn a_cluster_with_a_secret_works_for_its_roles_and_refuses_everyone_else() {
    let (master, storage) = secured_cluster();
    let rt = common::rt();
    let (segment_id, data_addr) = rt.block_on(async {
        // The client library, over TCP (grants on every slice) and over
        // shared memory only (a grant and the secret's proof map the
        // segment; no fallback to TCP hides a refusal).
        for transport in [Transport::Tcp, Transport::Shm] {
            let c = Client::connect(&master.addr, client_cfg(SECRET, transport))
                .await
                .unwrap_or_else(|e| panic!("{transport:?}: {e}"));
            let big = vec![0xabu8; 5 << 20]; // several TCP slices
            c.put(b"big", &big).await.unwrap();
            assert_eq!(c.get(b"big").await.unwrap(), big);
            c.put(b"small", b"hello").await.unwrap();
            assert_eq!(c.get(b"small").await.unwrap(), b"hello");
            let got = c.batch_get(&[b"big".as_slice(), b"small"]).await.unwrap();
            assert_eq!(got[1].as_ref().unwrap(), b"hello");
            c.remove_with(b"big", true).await.unwrap();
            c.remove_with(b"small", true).await.unwrap();
        }
        let c = Client::connect(&master.addr, client_cfg(SECRET, Transport::Tcp))
            .await
            .unwrap();
        c.put(b"kept", b"precious").await.unwrap();
        let seg = c.stat().await.unwrap().segments[0].clone();
        (seg.id, seg.endpoint.shard_addr(0))
    });

    // The CLI takes the secret from the environment.
    let env = [("KVPOOL_SECRET", SECRET)];
    let (code, _, err) = common::cli_env(&master.addr, &["put", "cli-key", "-"], Some(b"v"), &env);
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = common::cli_env(&master.addr, &["get", "cli-key"], None, &env);
    assert_eq!((code, out.as_slice()), (0, b"v".as_slice()), "{err}");
    // Without it, or with another one: refused, with the code that says why.
    let (code, _, err) = common::cli(&master.addr, &["get", "cli-key"], None);
    assert_eq!(code, 2);
    assert!(err.contains("Unauthenticated (17)"), "{err}");
    let wrong = [("KVPOOL_SECRET", "another-secret-of-enough-bytes")];
    let (code, _, err) = common::cli_env(&master.addr, &["stat"], None, &wrong);
    assert_eq!(code, 2);
    assert!(err.contains("Unauthenticated (17)"), "{err}");

    // Raw master frames from a peer without the secret.
    let attempts = [
        MasterRequest::RemoveAll { force: false },
        MasterRequest::MountSegment {
            client_id: 1,
            spec: fake_spec(),
        },
        MasterRequest::UnmountSegment {
            client_id: 1,
            segment_id,
        },
        MasterRequest::NvmeUpdates {
            client_id: 1,
            updates: vec![NvmeUpdate::Recovered {
                key: b"kept".to_vec(),
                nvme: segment_id,
                loc: 0,
                len: 8,
                sum: 0,
                version: 0,
            }],
        },
        MasterRequest::Stat,
        MasterRequest::Hello { client_id: 1 },
    ];
    for req in &attempts {
        assert_eq!(
            raw_master(&master.addr, req).map(|_| ()),
            Err(ErrorCode::Unauthenticated),
            "{}",
            req.op_name()
        );
    }
    // A wrong proof is refused too.
    let mut s = connect(&master.addr);
    let r: Result<MasterResponse, _> = common::exchange(
        &mut s,
        FrameKind::MasterRequest,
        1,
        &MasterRequest::AuthBegin {
            client_id: 5,
            nonce: auth::nonce(),
        },
        &[],
    );
    assert!(matches!(r, Ok(MasterResponse::AuthChallenge { .. })));
    let r: Result<MasterResponse, _> = common::exchange(
        &mut s,
        FrameKind::MasterRequest,
        2,
        &MasterRequest::AuthProve { proof: [7; 32] },
        &[],
    );
    assert_eq!(r.map(|_| ()), Err(ErrorCode::Unauthenticated));

    // An authenticated connection speaks for its own client id only.
    let mut s = authenticated(&master.addr, SECRET, 42);
    let r: Result<MasterResponse, _> = common::exchange(
        &mut s,
        FrameKind::MasterRequest,
        3,
        &MasterRequest::Ping {
            client_id: 43,
            segments: vec![],
        },
        &[],
    );
    assert_eq!(r.map(|_| ()), Err(ErrorCode::IllegalClient));
    // ...and may not unmount a node's segment.
    let r: Result<MasterResponse, _> = common::exchange(
        &mut s,
        FrameKind::MasterRequest,
        4,
        &MasterRequest::UnmountSegment {
            client_id: 42,
            segment_id,
        },
        &[],
    );
    assert_eq!(r.map(|_| ()), Err(ErrorCode::IllegalClient));

    // The data plane: a connection that has not proved the secret sends
    // nothing (below, with a real grant too); one that has needs a grant
    // for each range: no grant, no bytes in or out.
    let data = |req: &DataRequest, payload: &[u8]| -> Result<DataResponse, ErrorCode> {
        common::exchange(
            &mut data_authenticated(&data_addr, SECRET),
            FrameKind::DataRequest,
            5,
            req,
            payload,
        )
    };
    let none = Grant::default();
    assert_eq!(
        data(
            &DataRequest::Write {
                segment_id,
                offset: 0,
                len: 8,
                grant: none,
            },
            b"poisoned",
        )
        .map(|_| ()),
        Err(ErrorCode::Unauthenticated)
    );
    assert_eq!(
        data(
            &DataRequest::Read {
                segment_id,
                offset: 0,
                len: 8,
                grant: none,
            },
            &[],
        )
        .map(|_| ()),
        Err(ErrorCode::Unauthenticated)
    );
    // A real grant works only for its own range and operation.
    let r: Result<MasterResponse, _> = common::exchange(
        &mut s,
        FrameKind::MasterRequest,
        6,
        &MasterRequest::PutStart {
            client_id: 42,
            key: b"granted".to_vec(),
            len: 4096,
            opts: Default::default(),
        },
        &[],
    );
    let Ok(MasterResponse::Replicas(reps)) = r else {
        panic!("{r:?}")
    };
    let rep: &ReplicaDesc = &reps[0];
    let write = |offset: u64| {
        data(
            &DataRequest::Write {
                segment_id,
                offset,
                len: 4096,
                grant: rep.grant,
            },
            &[1u8; 4096],
        )
    };
    assert_eq!(write(rep.offset), Ok(DataResponse::Written));
    let unproved = common::exchange::<_, DataResponse>(
        &mut connect(&data_addr),
        FrameKind::DataRequest,
        5,
        &DataRequest::Write {
            segment_id,
            offset: rep.offset,
            len: 4096,
            grant: rep.grant,
        },
        &[2u8; 4096],
    );
    assert_eq!(
        unproved.map(|_| ()),
        Err(ErrorCode::Unauthenticated),
        "a live grant on a connection that did not prove the secret"
    );
    assert_eq!(
        write(rep.offset + 4096).map(|_| ()),
        Err(ErrorCode::Unauthenticated),
        "outside the granted range"
    );
    assert_eq!(
        data(
            &DataRequest::Read {
                segment_id,
                offset: rep.offset,
                len: 4096,
                grant: rep.grant,
            },
            &[],
        )
        .map(|_| ()),
        Err(ErrorCode::Unauthenticated),
        "a write grant is no read grant"
    );

    // The segment is not handed to a local process without a grant, nor
    // to one that shows a live grant without proving the secret (issue 29:
    // a grant seen on the wire mapped the whole segment until it expired).
    let shm_request = |grant: &kvpool_wire::auth::Grant| {
        let mut req = Vec::from(*b"KVSQ");
        req.extend_from_slice(&segment_id.to_le_bytes());
        req.push(grant.op);
        req.extend_from_slice(&grant.offset.to_le_bytes());
        req.extend_from_slice(&grant.len.to_le_bytes());
        req.extend_from_slice(&grant.expires_ms.to_le_bytes());
        req.extend_from_slice(&grant.mac);
        req.extend_from_slice(&grant.term.to_le_bytes());
        req
    };
    // What a local process gets for `req` (after the node's challenge when
    // `after_challenge`): everything the socket sends until it closes.
    let shm_answer = |req: &[u8], after_challenge: bool| {
        use std::os::linux::net::SocketAddrExt;
        let name = kvpool_transport::shm::socket_name(segment_id);
        let a = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let mut un = std::os::unix::net::UnixStream::connect_addr(&a).unwrap();
        un.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut got = Vec::new();
        if after_challenge {
            let mut c = [0u8; 20];
            un.read_exact(&mut c).unwrap();
            assert_eq!(&c[..4], b"KVSC");
            got.extend_from_slice(&c);
        }
        un.write_all(req).unwrap();
        let _ = un.read_to_end(&mut got);
        got
    };
    let handed = |got: &[u8]| got.windows(4).any(|w| w == b"KVSH");
    let none = kvpool_wire::auth::Grant::default();
    let live = shm_request(&rep.grant);
    for (what, req, after) in [
        ("no grant", shm_request(&none), false),
        ("a live grant, no proof", live.clone(), false),
        (
            "a live grant, no proof, after the challenge",
            live.clone(),
            true,
        ),
        (
            "a live grant and a zero proof",
            [live.clone(), vec![0; 32]].concat(),
            true,
        ),
    ] {
        let got = shm_answer(&req, after);
        assert!(!handed(&got), "{what}: the segment was handed over");
    }

    // Admin HTTP: reading segment ids, offsets and endpoints needs the
    // secret (issue 29, item 7); so does removing everything.
    for route in ["/api/v1/segments", "/api/v1/keys/kept"] {
        let (status, body) = common::http(&master.http, "GET", route);
        assert_eq!(status, 401, "{route}: {body}");
        assert!(
            !body.contains("segment_id") && !body.contains("endpoint"),
            "{body}"
        );
        let (status, body) = common::http_with(
            &master.http,
            "GET",
            route,
            &format!("Authorization: Bearer {SECRET}\r\n"),
        );
        assert_eq!(status, 200, "{route}: {body}");
        assert!(body.contains("endpoint"), "{route}: {body}");
    }
    let (status, body) = common::http(&master.http, "GET", "/get_all_segments");
    assert_eq!(status, 401, "segment names without the secret: {body}");
    let (status, body) = common::http(&master.http, "POST", "/api/v1/remove_all");
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("Unauthenticated"), "{body}");
    let (status, _) = common::http_with(
        &master.http,
        "POST",
        "/api/v1/remove_all",
        "Authorization: Bearer not-the-secret\r\n",
    );
    assert_eq!(status, 401);

    // Nothing above changed the pool.
    rt.block_on(async {
        let c = Client::connect(&master.addr, client_cfg(SECRET, Transport::Tcp))
            .await
            .unwrap();
        assert_eq!(c.get(b"kept").await.unwrap(), b"precious");
        let s = c.stat().await.unwrap();
        assert_eq!(s.segments.len(), 1, "no fake segment: {s:?}");
    });
    let (status, body) = common::http_with(
        &master.http,
        "POST",
        "/api/v1/remove_all",
        &format!("Authorization: Bearer {SECRET}\r\n"),
    );
    assert_eq!(status, 200, "{body}");

    // The refusals were logged, and counted.
    assert!(master.stderr().contains("refused"), "{}", master.stderr());
    assert!(storage.stderr().contains("refused"), "{}", storage.stderr());
    let (_, m) = common::http(&master.http, "GET", "/metrics");
    assert!(
        m.lines()
            .any(|l| l.starts_with("kvpool_master_auth_refusals_total ") && !l.ends_with(" 0")),
        "{m}"
    );
}

/// Issue 29, item 4: a write grant travels in clear text, and was a bearer
/// token: captured from a secret holder's put and replayed by a process
/// without the secret, it wrote its range after the put had ended, for the
/// grant's 35 s, and readers got `Corrupt`. Now a data connection proves the
/// secret before anything else: the replay is refused on a raw socket, and
/// the value reads back as it was put.
#[test]
fn a_write_grant_seen_on_the_wire_cannot_be_replayed_without_the_secret() {
    let (master, storage) = secured_cluster();
    let _storage = storage;
    let mut m = authenticated(&master.addr, SECRET, 77);
    let value = vec![0x5au8; 4096];
    let r: Result<MasterResponse, _> = common::exchange(
        &mut m,
        FrameKind::MasterRequest,
        3,
        &MasterRequest::PutStart {
            client_id: 77,
            key: b"sealed".to_vec(),
            len: value.len() as u64,
            opts: Default::default(),
        },
        &[],
    );
    let Ok(MasterResponse::Replicas(reps)) = r else {
        panic!("{r:?}")
    };
    let rep = reps[0].clone();
    let data_addr = rep.endpoint.shard_addr(rep.data_shard());
    // The writer (it holds the secret) writes and ends its put.
    let write = DataRequest::Write {
        segment_id: rep.segment_id,
        offset: rep.offset,
        len: value.len() as u64,
        grant: rep.grant,
    };
    let mut w = data_authenticated(&data_addr, SECRET);
    assert_eq!(
        common::exchange(&mut w, FrameKind::DataRequest, 3, &write, &value),
        Ok(DataResponse::Written)
    );
    let r: Result<MasterResponse, _> = common::exchange(
        &mut m,
        FrameKind::MasterRequest,
        4,
        &MasterRequest::PutEnd {
            client_id: 77,
            key: b"sealed".to_vec(),
            put_id: 0,
            checksum: Some(xxhash_rust::xxh3::xxh3_64(&value)),
        },
        &[],
    );
    assert_eq!(r, Ok(MasterResponse::Done));
    // The grant, seen on the wire, replayed from a process without the
    // secret, on every shard port of the node: refused.
    for shard in 0..rep.endpoint.nr_shards {
        let r = common::exchange::<_, DataResponse>(
            &mut connect(&rep.endpoint.shard_addr(shard)),
            FrameKind::DataRequest,
            1,
            &write,
            &[0xeeu8; 4096],
        );
        assert_eq!(
            r.map(|_| ()),
            Err(ErrorCode::Unauthenticated),
            "shard {shard}"
        );
    }
    // A handshake with a made-up proof does not open the door either.
    let mut s = connect(&data_addr);
    let r: Result<DataResponse, _> = common::exchange(
        &mut s,
        FrameKind::DataRequest,
        1,
        &DataRequest::AuthBegin {
            client_id: 0,
            nonce: auth::nonce(),
        },
        &[],
    );
    assert!(matches!(r, Ok(DataResponse::AuthChallenge { .. })), "{r:?}");
    let r: Result<DataResponse, _> = common::exchange(
        &mut s,
        FrameKind::DataRequest,
        2,
        &DataRequest::AuthProve { proof: [3; 32] },
        &[],
    );
    assert_eq!(r.map(|_| ()), Err(ErrorCode::Unauthenticated));
    // The value is what was put.
    let rt = common::rt();
    let got = rt.block_on(async {
        let c = Client::connect(&master.addr, client_cfg(SECRET, Transport::Tcp))
            .await
            .unwrap();
        c.get(b"sealed").await
    });
    assert_eq!(got.expect("the value as put"), value);
}

#[test]
fn a_client_without_the_secret_or_with_another_is_refused_at_connect() {
    let (master, _storage) = secured_cluster();
    let rt = common::rt();
    rt.block_on(async {
        let e = Client::connect(&master.addr, client_cfg("", Transport::Tcp))
            .await
            .err()
            .expect("no secret");
        assert_eq!(e.code, ErrorCode::Unauthenticated, "{e}");
        let e = Client::connect(
            &master.addr,
            client_cfg("another-secret-of-enough-bytes", Transport::Tcp),
        )
        .await
        .err()
        .expect("another secret");
        assert_eq!(e.code, ErrorCode::Unauthenticated, "{e}");
    });
}

#[test]
fn a_client_with_a_secret_does_not_trust_an_open_master() {
    let node = common::start("all", &common::ephemeral(&["--segment-size", "64MiB"]));
    let rt = common::rt();
    let e = rt
        .block_on(Client::connect(
            &node.addr,
            client_cfg(SECRET, Transport::Tcp),
        ))
        .err()
        .expect("an open master cannot prove the secret");
    assert_eq!(e.code, ErrorCode::Unauthenticated, "{e}");
}

#[test]
fn an_open_cluster_listening_beyond_loopback_says_so_loudly() {
    let mut open = common::start(
        "master",
        &[
            "--listen",
            "0.0.0.0:0",
            "--http",
            "127.0.0.1:0",
            "--shards",
            "1",
        ],
    );
    assert!(
        open.stderr().contains("THIS CLUSTER IS OPEN"),
        "{}",
        open.stderr()
    );
    open.signal(common::Signal::TERM);
    open.wait_exit(Duration::from_secs(10)).expect("stopped");
    let closed = common::start_env(
        "master",
        &[
            "--listen",
            "0.0.0.0:0",
            "--http",
            "127.0.0.1:0",
            "--shards",
            "1",
        ],
        &[("KVPOOL_SECRET", SECRET)],
    );
    assert!(!closed.stderr().contains("THIS CLUSTER IS OPEN"));
    let local = common::start(
        "master",
        &[
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--shards",
            "1",
        ],
    );
    assert!(!local.stderr().contains("THIS CLUSTER IS OPEN"));
}

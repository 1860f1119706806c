//! Bad bytes on the master's and a storage node's ports: each such connection
//! gets an error frame or is closed, and the process keeps serving others.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvpool_client::Client;
use kvpool_config::ClientConfig;
use kvpool_wire::frame::{self, FrameHeader, FrameKind, HEADER_LEN};
use kvpool_wire::proto::{MasterRequest, WireError};
use kvpool_wire::ErrorCode;

/// What the peer did with a bad connection.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// It answered with an error frame carrying this code, then closed.
    Error(ErrorCode),
    /// It closed without answering.
    Closed,
}

/// Sends `bytes` (then half-closes if `finish`), reads until the peer closes.
/// Panics if the peer neither answers nor closes within `within`.
fn poke(addr: &str, bytes: &[u8], finish: bool, within: Duration) -> Outcome {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(within)).unwrap();
    s.write_all(bytes).unwrap();
    if finish {
        s.shutdown(std::net::Shutdown::Write).unwrap();
    }
    let started = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("peer at {addr} neither answered nor closed within {within:?} ({e})"),
        }
        assert!(started.elapsed() < within, "peer kept the connection open");
    }
    if got.len() < HEADER_LEN {
        return Outcome::Closed;
    }
    let hdr = FrameHeader::decode(&got[..HEADER_LEN].try_into().unwrap(), u32::MAX).unwrap();
    assert_eq!(
        hdr.kind,
        FrameKind::Error,
        "only an error frame may come back"
    );
    let mut payload = rkyv::util::AlignedVec::<16>::new();
    payload.extend_from_slice(&got[HEADER_LEN..HEADER_LEN + hdr.len as usize]);
    let e: WireError = frame::decode(&payload).unwrap();
    Outcome::Error(ErrorCode::from_code(e.code))
}

fn header(kind: FrameKind, len: u32) -> Vec<u8> {
    FrameHeader {
        kind,
        request_id: 1,
        len,
    }
    .encode()
    .to_vec()
}

/// Every kind of bad input against one port; `kind` is the port's request kind.
fn assert_rejects_bad_input(addr: &str, kind: FrameKind, max_frame: u32) {
    let t = Duration::from_secs(5);
    // Garbage: not a kvpool frame at all.
    assert_eq!(
        poke(addr, &[0xAB; 64], false, t),
        Outcome::Error(ErrorCode::Malformed)
    );
    // An oversize length: refused before a byte of payload is read.
    assert_eq!(
        poke(addr, &header(kind, u32::MAX), false, t),
        Outcome::Error(ErrorCode::TooLarge)
    );
    assert_eq!(
        poke(addr, &header(kind, max_frame + 1), false, t),
        Outcome::Error(ErrorCode::TooLarge)
    );
    // An unknown protocol version.
    let mut v = header(kind, 0);
    v[4] = 99;
    assert_eq!(
        poke(addr, &v, false, t),
        Outcome::Error(ErrorCode::Unsupported)
    );
    // A valid header whose payload fails validation.
    let mut f = header(kind, 32);
    f.extend_from_slice(&[0xFF; 32]);
    assert_eq!(
        poke(addr, &f, false, t),
        Outcome::Error(ErrorCode::Malformed)
    );
    // A truncated frame: the peer sees end-of-stream mid-payload and closes.
    let mut f = header(kind, 100);
    f.extend_from_slice(&[0u8; 10]);
    assert_eq!(poke(addr, &f, true, t), Outcome::Closed);
    // A truncated header.
    assert_eq!(poke(addr, &header(kind, 10)[..7], true, t), Outcome::Closed);
    // The wrong kind of frame for this port.
    let wrong = frame::encode(FrameKind::MasterResponse, 1, &MasterRequest::Stat);
    assert_eq!(
        poke(addr, &wrong, false, t),
        Outcome::Error(ErrorCode::Malformed)
    );
}

#[test]
fn master_and_storage_ports_reject_bad_frames_and_keep_serving() {
    let node = common::start("all", &common::ephemeral(&["--segment-size", "64MiB"]));
    let rt = common::rt();
    let client = rt
        .block_on(Client::connect(&node.addr, ClientConfig::default()))
        .unwrap();
    rt.block_on(client.put(b"before", b"still here")).unwrap();
    let stat = rt.block_on(client.stat()).unwrap();
    let storage_addr = stat.segments[0].endpoint.shard_addr(0);

    // A healthy connection opened before the attack keeps working after it.
    let mut bystander = TcpStream::connect(&node.addr).unwrap();

    assert_rejects_bad_input(&node.addr, FrameKind::MasterRequest, 4 << 20);
    assert_rejects_bad_input(&storage_addr, FrameKind::DataRequest, 64 << 10);

    bystander
        .write_all(&frame::encode(
            FrameKind::MasterRequest,
            9,
            &MasterRequest::Exist {
                key: b"before".to_vec(),
            },
        ))
        .unwrap();
    bystander
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut hdr = [0u8; HEADER_LEN];
    bystander.read_exact(&mut hdr).unwrap();
    assert_eq!(
        FrameHeader::decode(&hdr, u32::MAX).unwrap().kind,
        FrameKind::MasterResponse
    );

    // The process is alive and serves new clients, data plane included.
    let client = rt
        .block_on(Client::connect(&node.addr, ClientConfig::default()))
        .unwrap();
    assert_eq!(rt.block_on(client.get(b"before")).unwrap(), b"still here");
    rt.block_on(client.put(b"after", &[3u8; 200_000])).unwrap();
    assert_eq!(rt.block_on(client.get(b"after")).unwrap().len(), 200_000);
}

#[test]
fn a_stalled_frame_is_dropped_after_the_io_deadline() {
    let dir = std::env::temp_dir().join(format!("kvpool-malformed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("fast-timeouts.toml");
    std::fs::write(&cfg, "[master]\nio_timeout_ms = 500\n").unwrap();
    let cfg = cfg.to_str().unwrap().to_string();
    let mut args = common::ephemeral(&["--segment-size", "64MiB"]);
    args.splice(0..0, ["--config", cfg.as_str()]);
    let node = common::start("all", &args);
    // Half a frame, then silence (no close): the master must not wait
    // forever; it says why and closes.
    let mut f = header(FrameKind::MasterRequest, 100);
    f.extend_from_slice(&[0u8; 10]);
    let started = Instant::now();
    assert_eq!(
        poke(&node.addr, &f, false, Duration::from_secs(5)),
        Outcome::Error(ErrorCode::Timeout)
    );
    assert!(started.elapsed() < Duration::from_secs(3));
    let _ = std::fs::remove_dir_all(&dir);
}

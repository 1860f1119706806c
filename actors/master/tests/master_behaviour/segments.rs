//! Segments over time: clients' liveness and the unmount of a dead
//! node's segments, draining, and the segment states a restarted master
//! finds in its state directory.

use super::*;

#[test]
fn a_silent_storage_node_has_its_segments_unmounted_after_client_ttl() {
    let mut m = M::new(2);
    m.mount_as(NODE, "dead-node", 64 * KIB, "h1");
    m.mount_as(NODE + 1, "live-node", 64 * KIB, "h2");
    m.put_with("both", 10, opts(2));
    m.put("solo", 10);
    m.kill(NODE);
    m.advance(m.cfg.client_ttl_ms - 1000);
    assert_eq!(
        m.stat().segments.len(),
        2,
        "not yet: silent for less than client_ttl"
    );
    m.advance(1000);
    let s = m.stat();
    assert_eq!(s.segments.len(), 1);
    assert_eq!(s.segments[0].name, "live-node");
    assert_eq!(m.get("both").unwrap().len(), 1, "the surviving replica");
    // "solo" was placed on one of the two; it is readable only if it survived.
    let solo_ok = m.get("solo").is_ok();
    assert_eq!(solo_ok, m.stat().keys == 2);
    assert!(m.start("new", 10).is_ok(), "new puts go to the survivor");
}

#[test]
fn a_pinging_storage_node_keeps_its_segments() {
    let mut m = M::new(1);
    m.mount("seg", 64 * KIB);
    m.advance(30 * m.cfg.client_ttl_ms);
    assert_eq!(m.stat().segments.len(), 1);
}

#[test]
fn a_silent_writer_has_its_processing_puts_revoked() {
    let mut m = M::new(2);
    m.mount("seg", 64 * KIB);
    m.ping(WRITER); // the writer is a pinging client, then goes silent
    m.start("k", 10).unwrap();
    m.advance(m.cfg.client_ttl_ms - 1000);
    assert_eq!(code(m.get("k")), ErrorCode::ReplicaNotReady, "not yet");
    m.advance(1000);
    assert_eq!(code(m.get("k")), ErrorCode::ObjectNotFound);
    assert!(m.start_with(OTHER, "k", 10, opts(1)).is_ok());
}

#[test]
fn a_draining_segment_keeps_serving_reads_and_takes_no_new_puts() {
    let mut m = M::new(1);
    let a = m.mount("a", 64 * KIB);
    let b = m.mount("b", 64 * KIB);
    m.put_with("k", 10, opts(2));
    m.call(Q::DrainSegment { segment_id: a }).unwrap();
    assert!(m.stat().segments.iter().any(|s| s.id == a && s.draining));
    assert_eq!(
        m.get("k").unwrap().len(),
        2,
        "existing replicas stay readable"
    );
    for i in 0..10 {
        let r = m.start(&format!("n{i}"), 10).unwrap();
        assert_eq!(r[0].segment_id, b);
    }
}

/// Whether stat says mounted segment `id` is draining.
fn draining(m: &mut M, id: SegmentId) -> bool {
    m.stat()
        .segments
        .iter()
        .find(|s| s.id == id)
        .expect("mounted")
        .draining
}

/// Issue 32, segment states in the state directory: a drain is recorded,
/// so a master restarted on its directory (from the log, then from a
/// snapshot) has the segment draining again when it mounts; the drain ends
/// with the segment's unmount. Before, a restart (or a standby's takeover)
/// forgot the drain and placed new puts on the segment again.
#[test]
fn a_drain_survives_a_master_restart_and_ends_with_the_unmount() {
    let dir = state_dir("drain");
    let mut m = on_state_dir(&dir, 1_000);
    let a = m.mount("a", 64 * KIB);
    let b = m.mount("b", 64 * KIB);
    m.call(Q::DrainSegment { segment_id: a }).unwrap();
    drop(m);
    for (restart, compact) in [(1, true), (2, false)] {
        let mut m = on_state_dir(&dir, 120_000 * restart);
        assert_eq!(m.mount("a", 64 * KIB), a);
        assert_eq!(m.mount("b", 64 * KIB), b);
        assert!(
            draining(&mut m, a),
            "restart {restart}: a is draining again"
        );
        assert!(!draining(&mut m, b));
        for i in 0..8 {
            let r = m.start(&format!("r{restart}-{i}"), 10).unwrap();
            assert_eq!(r[0].segment_id, b, "restart {restart}: no new put on a");
        }
        if compact {
            while m.m.compact_step(2).unwrap() {}
        }
    }
    let mut m = on_state_dir(&dir, 360_000);
    m.mount("a", 64 * KIB);
    m.call(Q::UnmountSegment {
        client_id: NODE,
        segment_id: a,
    })
    .unwrap();
    m.mount("a", 64 * KIB);
    assert!(!draining(&mut m, a), "the unmount ended the drain");
    drop(m);
    let mut m = on_state_dir(&dir, 480_000);
    m.mount("a", 64 * KIB);
    assert!(!draining(&mut m, a), "and a restart does not bring it back");
    std::fs::remove_dir_all(&dir).ok();
}

/// A drain is each shard's, in each shard's log: a crash after one shard
/// wrote it and before another did leaves it on some shards only. Stat
/// then says the segment is not draining (it is not, for the keys of the
/// shard without the record), and a drain asked again reaches every shard.
#[test]
fn a_drain_one_shard_did_not_record_before_a_crash_shows_as_not_draining() {
    let dir = state_dir("drain-torn");
    let open = |now: u64| {
        let cfg = cfg();
        M {
            m: MasterCore::open(2, &cfg, 42, &dir, now, 1_700_000_000_000).expect("open"),
            now,
            cfg,
            live: Vec::new(),
        }
    };
    let mut m = open(1_000);
    let a = m.mount("a", 64 * KIB);
    m.mount("b", 64 * KIB);
    m.call(Q::DrainSegment { segment_id: a }).unwrap();
    assert!(draining(&mut m, a));
    drop(m);
    // Shard 1's last record, the drain (an 18-byte frame), never reached
    // its log.
    let shard1 = dir.join("shard-1");
    let log = std::fs::read_dir(&shard1)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with("log-"))
        .max()
        .expect("shard 1's log");
    let len = std::fs::metadata(&log).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&log)
        .unwrap()
        .set_len(len - 18)
        .unwrap();
    let mut m = open(120_000);
    m.mount("a", 64 * KIB);
    m.mount("b", 64 * KIB);
    assert!(
        !draining(&mut m, a),
        "drained on shard 0 only: not shown as draining"
    );
    m.call(Q::DrainSegment { segment_id: a }).unwrap();
    assert!(draining(&mut m, a), "drained again, on every shard");
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 32: every segment a master had mounted is in its state directory,
/// so after a restart a put with no room waits (`TryAgain`) for one that
/// has not mounted again even if it held nothing; once the wait is over
/// the segment is recorded gone and the next restart does not wait for it.
/// Before, only segments some recovered object or hold named were waited
/// for, and such a put heard `NoSpace` while the empty segment's node was
/// about to mount it.
#[test]
fn a_restarted_master_waits_for_a_segment_it_had_mounted_even_an_empty_one() {
    let dir = state_dir("awaiting");
    let mut m = on_state_dir(&dir, 1_000);
    let small = m.mount("small", 64 * KIB);
    m.mount("big", 512 * KIB);
    assert_eq!(m.put("k", KIB)[0].segment_id, small, "big holds nothing");
    drop(m);
    let mut m = on_state_dir(&dir, 120_000);
    m.mount("small", 64 * KIB);
    assert_eq!(code(m.start("large", 200 * KIB)), ErrorCode::TryAgain);
    m.mount("big", 512 * KIB);
    assert!(m.start("large", 200 * KIB).is_ok(), "fits once it mounted");
    drop(m);
    let mut m = on_state_dir(&dir, 240_000);
    m.mount("small", 64 * KIB);
    assert_eq!(code(m.start("larger", 200 * KIB)), ErrorCode::TryAgain);
    m.advance(m.cfg.client_ttl_ms);
    assert_eq!(
        code(m.start("larger", 200 * KIB)),
        ErrorCode::NoSpace,
        "the wait is over"
    );
    drop(m);
    let mut m = on_state_dir(&dir, 360_000);
    m.mount("small", 64 * KIB);
    assert_eq!(
        code(m.start("larger", 200 * KIB)),
        ErrorCode::NoSpace,
        "given up, it is not waited for again"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn drain_of_an_unknown_segment_is_segment_not_found() {
    let mut m = M::new(1);
    assert_eq!(
        code(m.call(Q::DrainSegment { segment_id: 99 })),
        ErrorCode::SegmentNotFound
    );
}

/// A standby takes over from the records its leader shipped: the bytes a
/// shard's `take_records` wrote, checked by `ship::decode_records`, applied
/// to its image, then `recover` (what the service's take-over runs). A drain
/// the leader recorded holds on the new leader once the segment mounts.
#[test]
fn a_drain_the_leader_shipped_holds_after_a_standby_takes_over() {
    use kvpool_master::journal::Image;
    use kvpool_master::state::{ShardConfig, ShardState};
    use kvpool_wire::proto::{segment_id_for, MasterResponse};
    let cfg = cfg();
    let shard = |cfg: &MasterConfig| {
        ShardState::new(0, 1, ShardConfig::from_master(cfg, 1), 42)
            .with_durability(1_700_000_000_000)
    };
    let (a, b) = (segment_id_for("a"), segment_id_for("b"));
    let mount = |s: &mut ShardState, id: SegmentId, name: &str, now: u64| {
        s.add_segment(id, Arc::new(spec(name, 64 * KIB, "host-a")), NODE, now);
    };
    let mut leader = shard(&cfg);
    mount(&mut leader, a, "a", 0);
    mount(&mut leader, b, "b", 0);
    assert!(leader.drain_segment(a));
    let mut shipped = Vec::new();
    leader.take_records(&mut shipped);
    let map = kvpool_runtime::hash::ShardMap::new(1).unwrap();
    let mut image = Image::default();
    for r in kvpool_master::ship::decode_records(&shipped, 0, |k| map.shard_of(k)).unwrap() {
        image.apply(r);
    }
    let mut standby = shard(&cfg);
    standby.recover(image, 1_000, cfg.client_ttl_ms);
    mount(&mut standby, a, "a", 1_000);
    mount(&mut standby, b, "b", 1_000);
    assert!(
        standby.stat().segments.iter().any(|s| s.0 == a && s.3),
        "a is draining on the new leader"
    );
    for i in 0..8 {
        let put = standby.apply(
            Q::PutStart {
                client_id: WRITER,
                key: format!("k{i}").into_bytes(),
                len: 10,
                opts: opts(1),
            },
            1_000,
        );
        match put {
            Ok(MasterResponse::Replicas(r)) => assert_eq!(r[0].segment_id, b, "k{i} on a"),
            other => panic!("k{i}: {other:?}"),
        }
    }
}

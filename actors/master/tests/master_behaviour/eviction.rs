//! Eviction, leases and pins.

use super::*;

// ---- pins and eviction ------------------------------------------------------------

/// One shard, one segment of 100 KiB, objects of 1 KiB.
pub(super) fn small_pool() -> M {
    let mut m = M::new(1);
    m.mount("seg", 100 * KIB);
    m
}

pub(super) fn fill(m: &mut M, prefix: &str, n: usize, o: PutOptions) {
    for i in 0..n {
        m.put_with(&format!("{prefix}{i}"), KIB, o.clone());
        m.advance(1);
    }
}

#[test]
fn passing_the_high_watermark_evicts_about_eviction_ratio_of_the_segment() {
    let mut m = small_pool();
    fill(&mut m, "k", 90, opts(1));
    assert_eq!(m.stat().keys, 90, "90% is not past the watermark");
    m.advance(m.cfg.lease_ttl_ms); // a lease past the puts
    m.put("k90", KIB);
    let s = m.stat();
    assert_eq!(s.evictions, 5, "5% of 100 KiB = 5 objects of 1 KiB");
    assert_eq!(s.evicted_bytes, 5 * KIB);
    assert_eq!(s.keys, 86);
}

#[test]
fn eviction_takes_the_oldest_lease_first() {
    let mut m = small_pool();
    fill(&mut m, "k", 90, opts(1));
    // Read the five oldest: their leases now end last.
    for i in 0..5 {
        m.get(&format!("k{i}")).unwrap();
    }
    m.advance(m.cfg.lease_ttl_ms);
    m.put("trigger", KIB);
    for i in 0..5 {
        assert!(m.exist(&format!("k{i}")), "recently read k{i} survived");
    }
    for i in 5..10 {
        assert!(!m.exist(&format!("k{i}")), "k{i}, the oldest unread, went");
    }
}

#[test]
fn leased_objects_are_not_evicted() {
    let mut m = small_pool();
    fill(&mut m, "k", 90, opts(1));
    for i in 0..90 {
        m.get(&format!("k{i}")).unwrap();
    }
    m.put("trigger", KIB);
    assert_eq!(m.stat().evictions, 0);
    assert_eq!(m.stat().keys, 91);
}

/// A put is a use (issue 31): where eviction drops the only copy, a value
/// is kept for a lease after its put as after a read, so a writer (or the
/// decode instance it hands the key to) reads back what it was told is
/// stored. Was: unread values ranked by their completion time, before
/// every value read since, and a pool under pressure dropped a value put a
/// moment ago.
#[test]
fn a_value_is_kept_for_a_lease_after_its_put_as_after_a_read() {
    let mut m = small_pool();
    fill(&mut m, "read", 89, opts(1));
    for i in 0..89 {
        m.get(&format!("read{i}")).unwrap(); // leased until now + ttl
    }
    m.put("new", KIB); // 90%: not past the watermark
    m.advance(10);
    m.put("trigger", KIB); // past it: an eviction episode is owed
    assert_eq!(
        m.stat().evictions,
        0,
        "nothing read or put within a lease goes"
    );
    assert!(m.exist("new"), "the value put a moment ago was dropped");
    // A lease later they rank by their last use and go in that order.
    m.advance(m.cfg.lease_ttl_ms);
    m.put("again", KIB);
    assert!(m.stat().evictions > 0);
    assert!(m.exist("again"));
    // Nothing left to take but values put within a lease: the pool says so.
    let mut c = cfg();
    c.high_watermark = 1.0;
    let mut m = M::with(1, c);
    m.mount("seg", 10 * KIB);
    fill(&mut m, "k", 10, opts(1));
    assert_eq!(code(m.start("more", KIB)), ErrorCode::NoSpace);
    assert!(
        (0..10).all(|i| m.exist(&format!("k{i}"))),
        "nothing dropped"
    );
    m.advance(m.cfg.lease_ttl_ms);
    m.start("more", KIB).unwrap();
    assert!(!m.exist("k0"), "a lease later, the oldest put goes");
}

/// A master on a state directory, as `[master] state_dir` (a restart, or
/// the HA leader that takes over).
pub(super) fn on_state_dir(dir: &std::path::Path, now: u64) -> M {
    on_state_dir_with(dir, now, cfg())
}

/// [`on_state_dir`] with a configuration of the test's own.
pub(super) fn on_state_dir_with(dir: &std::path::Path, now: u64, cfg: MasterConfig) -> M {
    M {
        m: MasterCore::open(1, &cfg, 42, dir, now, 1_700_000_000_000).expect("open"),
        now,
        cfg,
        live: Vec::new(),
    }
}

/// Issue 29, item 7: the objects a restarted master (or a new HA leader)
/// recovers count as read at the take-over, and keys put since as read at
/// their put, so under pressure the older recovered objects go first. Was:
/// recovered objects ranked a lease after the take-over and new puts at
/// their completion, so the first keys the new leader acknowledged were
/// evicted before every recovered one.
#[test]
fn after_a_restart_recovered_objects_are_evicted_before_keys_put_since() {
    let dir = state_dir("recovered");
    let mut m = on_state_dir(&dir, 1_000);
    m.mount("seg", 100 * KIB);
    fill(&mut m, "old", 45, opts(1));
    drop(m); // the master goes
    let mut m = on_state_dir(&dir, 120_000);
    m.mount("seg", 100 * KIB); // its node mounts again: the objects come back
    assert!(m.exist("old0") && m.exist("old44"));
    m.advance(10);
    fill(&mut m, "new", 45, opts(1));
    m.advance(m.cfg.lease_ttl_ms + 100); // every lease and keep is over
    m.put("trigger", KIB); // 91 of 100 KiB: past the watermark
    assert_eq!(m.stat().evictions, 5);
    for i in 0..45 {
        assert!(
            m.exist(&format!("new{i}")),
            "new{i}, put after the restart, went"
        );
    }
    let left = (0..45).filter(|i| m.exist(&format!("old{i}"))).count();
    assert_eq!(left, 40, "five recovered objects went");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn soft_pinned_objects_are_evicted_only_after_unpinned_ones() {
    let mut m = small_pool();
    let pinned = PutOptions {
        soft_pin_ttl_ms: 3_600_000,
        ..opts(1)
    };
    fill(&mut m, "pin", 10, pinned); // the oldest, but pinned
    fill(&mut m, "k", 80, opts(1));
    m.advance(m.cfg.lease_ttl_ms);
    m.put("trigger", KIB);
    assert_eq!(m.stat().evictions, 5);
    for i in 0..10 {
        assert!(m.exist(&format!("pin{i}")));
    }
    for i in 0..5 {
        assert!(!m.exist(&format!("k{i}")));
    }
}

#[test]
fn soft_pinned_objects_are_evicted_when_nothing_else_is_left() {
    let mut m = small_pool();
    let pinned = PutOptions {
        soft_pin_ttl_ms: 3_600_000,
        ..opts(1)
    };
    fill(&mut m, "pin", 90, pinned);
    m.advance(m.cfg.lease_ttl_ms);
    m.put("trigger", KIB);
    assert_eq!(
        m.stat().evictions,
        5,
        "a soft pin is a preference, not a guarantee"
    );
}

#[test]
fn an_expired_soft_pin_no_longer_protects() {
    let mut m = small_pool();
    let pinned = PutOptions {
        soft_pin_ttl_ms: 1_000,
        ..opts(1)
    };
    fill(&mut m, "pin", 10, pinned);
    fill(&mut m, "k", 80, opts(1));
    m.advance(m.cfg.lease_ttl_ms.max(2_000));
    m.put("trigger", KIB);
    for i in 0..5 {
        assert!(!m.exist(&format!("pin{i}")), "oldest, pin expired");
    }
}

#[test]
fn soft_pin_never_blocks_remove() {
    let mut m = small_pool();
    m.put_with(
        "k",
        KIB,
        PutOptions {
            soft_pin_ttl_ms: 60_000,
            ..opts(1)
        },
    );
    m.remove("k", false).unwrap();
    assert!(!m.exist("k"));
}

#[test]
fn hard_pinned_objects_are_never_evicted() {
    let mut m = small_pool();
    let hard = PutOptions {
        hard_pin: true,
        ..opts(1)
    };
    fill(&mut m, "hard", 90, hard);
    assert_eq!(code(m.start("next", 20 * KIB)), ErrorCode::NoSpace);
    assert_eq!(m.stat().evictions, 0);
    assert_eq!(m.stat().keys, 90);
}

#[test]
fn hard_pinned_objects_can_be_removed() {
    let mut m = small_pool();
    m.put_with(
        "k",
        KIB,
        PutOptions {
            hard_pin: true,
            ..opts(1)
        },
    );
    assert!(m.describe("k").hard_pin);
    m.remove("k", false).unwrap();
    assert!(!m.exist("k"));
}

#[test]
fn a_failed_allocation_evicts_then_retries_once() {
    let mut c = cfg();
    c.high_watermark = 1.0; // only a failed allocation evicts
    let mut m = M::with(1, c);
    m.mount("seg", 100 * KIB);
    fill(&mut m, "k", 100, opts(1));
    assert_eq!(m.stat().evictions, 0);
    m.advance(m.cfg.lease_ttl_ms);
    m.start("big", 3 * KIB).unwrap();
    let s = m.stat();
    assert_eq!(s.evictions, 5, "5% freed, then the allocation succeeded");
    assert!(!m.exist("k0") && !m.exist("k4") && m.exist("k5"));
}

#[test]
fn eviction_of_one_replica_keeps_the_object_readable_from_the_other() {
    let mut c = cfg();
    c.high_watermark = 1.0;
    let mut m = M::with(1, c);
    let a = m.mount("a", 10 * KIB);
    m.mount("b", 100 * KIB);
    m.put_with("two", KIB, opts(2));
    m.advance(1);
    for i in 0..9 {
        m.put_with(
            &format!("a{i}"),
            KIB,
            PutOptions {
                preferred_host: "host-a".into(),
                ..opts(1)
            },
        );
        m.advance(1);
    }
    // Segment a is full; a put that only fits there evicts "two"'s replica.
    m.advance(m.cfg.lease_ttl_ms);
    let big = m.start_with(WRITER, "big", 95 * KIB, opts(1)).unwrap();
    assert_ne!(big[0].segment_id, a);
    let r = m.get("two").unwrap();
    assert!(!r.is_empty(), "still readable");
}

#[test]
fn evicted_space_is_reused_by_new_puts() {
    let mut c = cfg();
    c.high_watermark = 1.0;
    let mut m = M::with(1, c);
    m.mount("seg", 10 * KIB);
    fill(&mut m, "k", 10, opts(1));
    let first = m.describe("k0").replicas[0].offset;
    m.advance(m.cfg.lease_ttl_ms);
    let r = m.start("new", KIB).unwrap();
    assert_eq!(r[0].offset, first, "the oldest object's space");
}

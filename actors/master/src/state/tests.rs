use super::*;

#[test]
fn a_task_queue_knows_which_drops_wait_in_it() {
    let drop = |k: &[u8], loc| {
        NodeTask::Drop(DropTask {
            key: k.to_vec(),
            loc,
            version: None,
        })
    };
    let mut q = TaskQueue::default();
    q.push_back(drop(b"a", 7));
    q.push_back(NodeTask::Persist(PersistTask {
        key: b"a".to_vec(),
        dram: 1,
        offset: 0,
        len: 1,
        demote: false,
        checksum: None,
        version: 0,
    }));
    q.push_back(drop(b"a", 7));
    q.push_back(drop(b"b", 7));
    assert!(q.has_drop(b"a", 7) && q.has_drop(b"b", 7));
    assert!(!q.has_drop(b"a", 8) && !q.has_drop(b"c", 7));
    q.pop_front();
    assert!(
        q.has_drop(b"a", 7),
        "the second Drop of the copy still waits"
    );
    q.pop_front();
    q.pop_front();
    assert!(!q.has_drop(b"a", 7));
    assert!(q.has_drop(b"b", 7));
    q.pop_front();
    assert!(!q.has_drop(b"b", 7) && q.len() == 0 && q.pop_front().is_none());
}

#[test]
fn an_object_stays_small() {
    // The master holds tens of millions of these: 200 bytes per object
    // beyond the key is the budget, map overhead included.
    // A slab slot is the key's pointer and the object: 80 bytes.
    assert!(
        std::mem::size_of::<Object>() <= 72,
        "{}",
        std::mem::size_of::<Object>()
    );
    assert_eq!(crate::objects::slab_slot_bytes(), 80);
    assert_eq!(std::mem::size_of::<Replica>(), 16);
}

/// The id of the complete object under `key`.
fn id(sh: &ShardState, key: &[u8]) -> Id {
    sh.objs.complete_id(key).expect("a complete object")
}

/// A shard with one DRAM segment of 1 MiB in slot 0.
fn shard_with_a_segment() -> ShardState {
    let cfg = ShardConfig::from_master(&MasterConfig::default(), 1);
    let mut sh = ShardState::new(0, 1, cfg, 7);
    let spec = SegmentSpec {
        name: "n:1:1".into(),
        size: 1 << 20,
        endpoint: kvpool_wire::proto::Endpoint {
            host: "127.0.0.1".into(),
            port: 1,
            nr_shards: 1,
        },
        slice_bytes: 1 << 20,
        host_id: "n".into(),
        tier: Tier::Dram,
        nvme: None,
    };
    sh.add_segment(9, Arc::new(spec), 1, 0);
    sh
}

/// A put whose only segment with room is suspect (a client could not
/// reach its node) waits for the mark to clear (`TryAgain`, which the
/// client retries within its deadline) instead of failing with
/// `NoSpace` (a fault test met that right after a lossy link healed).
#[test]
fn a_put_meeting_only_a_suspect_segment_is_told_to_try_again_not_no_space() {
    let mut sh = shard_with_a_segment();
    sh.set_suspect(9, true);
    let e = sh
        .put_start(1, b"k", 1000, &PutOptions::default(), 0)
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::TryAgain, "{e}");
    assert!(sh.objs.processing_id(b"k").is_none(), "nothing placed");
    // Too large for the segment even when it is reachable: no room.
    let e = sh
        .put_start(1, b"big", 2 << 20, &PutOptions::default(), 0)
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::NoSpace, "{e}");
    sh.set_suspect(9, false);
    sh.put_start(1, b"k", 1000, &PutOptions::default(), 0)
        .expect("placed once the node pinged");
    sh.check_invariants().expect("a consistent shard");
}

/// A put asking for two replicas where one segment has room is placed
/// on that one, and the next tick says so.
#[test]
fn a_put_placed_with_fewer_replicas_than_asked_is_reported_by_the_tick() {
    let mut sh = shard_with_a_segment();
    let two = PutOptions {
        replicas: 2,
        ..PutOptions::default()
    };
    let descs = sh.put_start(1, b"k", 1000, &two, 0).unwrap();
    assert_eq!(descs.len(), 1, "placed on the one segment there is");
    sh.put_start(1, b"one", 1000, &PutOptions::default(), 0)
        .unwrap();
    assert_eq!(sh.tick(1).fewer_replicas, 1, "one put of the two");
    assert_eq!(sh.tick(2).fewer_replicas, 0, "counted once");
}

fn shard_with_objects() -> ShardState {
    let mut sh = shard_with_a_segment();
    for k in [&b"a"[..], b"b", b"c"] {
        sh.put_start(1, k, 1000, &PutOptions::default(), 0).unwrap();
        sh.put_end(1, k, 0, None, 0).unwrap();
    }
    // A leased removal: its extent waits in `pending`.
    sh.get_replica_list(b"c", 0).unwrap();
    sh.remove(b"c", true, 0).unwrap();
    sh.check_invariants().expect("a consistent shard");
    sh
}

#[test]
fn space_accounting_that_does_not_add_up_is_reported() {
    let mut sh = shard_with_objects();
    // A replica's extent given back behind the object's back.
    let off = sh.objs.get(id(&sh, b"a")).replicas[0].offset;
    sh.slots[0].as_mut().unwrap().alloc.dealloc(off, 1000);
    let e = sh.check_invariants().unwrap_err();
    assert!(e.contains("in use"), "{e}");
}

#[test]
fn two_objects_on_one_extent_are_reported() {
    let mut sh = shard_with_objects();
    let off_a = sh.objs.get(id(&sh, b"a")).replicas[0].offset;
    let b = id(&sh, b"b");
    let off_b = sh.objs.get(b).replicas[0].offset;
    // b now claims a's bytes; its own extent is released so the total
    // still adds up: only the overlap is wrong.
    sh.slots[0].as_mut().unwrap().alloc.dealloc(off_b, 1000);
    sh.objs.update(b, |o| o.replicas[0].offset = off_a);
    sh.slots[0].as_mut().unwrap().alloc.alloc(1000).unwrap();
    let e = sh.check_invariants().unwrap_err();
    assert!(e.contains("overlaps"), "{e}");
}

#[test]
fn a_leased_removal_whose_extent_was_freed_early_is_reported() {
    let mut sh = shard_with_objects();
    let Reverse(p) = sh.pending.peek().unwrap();
    let (off, size) = (p.offset, p.size);
    sh.slots[0].as_mut().unwrap().alloc.dealloc(off, size);
    assert!(sh.check_invariants().is_err());
}

#[test]
fn an_eviction_index_that_misses_a_lease_change_is_reported() {
    let mut sh = shard_with_objects();
    // A read lease set behind the index's back: the object now ranks
    // later than its entry says.
    let a = id(&sh, b"a");
    sh.objs.get_mut_unindexed(a).extend_lease(60_000);
    let e = sh.check_invariants().unwrap_err();
    assert!(e.contains("eviction index"), "{e}");
}

#[test]
fn an_eviction_index_that_misses_a_replica_state_change_is_reported() {
    let mut sh = shard_with_objects();
    // A replica taken out of eviction's reach (Demoting) behind the
    // index's back: its entry stays.
    let a = id(&sh, b"a");
    sh.objs.get_mut_unindexed(a).replicas[0].state = ReplicaState::Demoting;
    sh.slots[0].as_mut().unwrap().demoting += demoting_extent(1000);
    let e = sh.check_invariants().unwrap_err();
    assert!(e.contains("eviction index"), "{e}");
}

#[test]
fn an_eviction_index_that_misses_a_soft_pin_is_reported() {
    let mut sh = shard_with_objects();
    let a = id(&sh, b"a");
    sh.objs.get_mut_unindexed(a).stored_mut().pin_end_ms = 60_000;
    let e = sh.check_invariants().unwrap_err();
    assert!(e.contains("soft pins"), "{e}");
}

#[test]
fn the_eviction_index_follows_changes_made_through_update() {
    let mut sh = shard_with_objects();
    let a = id(&sh, b"a");
    sh.objs.update(a, |o| o.extend_lease(60_000));
    sh.objs.update(a, |o| o.stored_mut().pin_end_ms = 90_000);
    sh.objs
        .update(a, |o| o.replicas[0].state = ReplicaState::Promoting);
    sh.check_invariants().expect("kept in step");
    sh.objs
        .update(a, |o| o.replicas[0].state = ReplicaState::Ready);
    sh.check_invariants().expect("kept in step");
}

#[test]
fn victims_come_in_rank_order_and_ended_pins_move_over_when_swept() {
    let mut sh = shard_with_a_segment();
    let ttl = sh.cfg.lease_ttl_ms;
    let put = |sh: &mut ShardState, k: &[u8], pin_ms: u64, now: u64| {
        let opts = PutOptions {
            soft_pin_ttl_ms: pin_ms,
            ..PutOptions::default()
        };
        sh.put_start(1, k, 64, &opts, now).unwrap();
        sh.put_end(1, k, 0, None, now).unwrap();
    };
    put(&mut sh, b"pinned-long", 10 * ttl, 1);
    put(&mut sh, b"pinned-short", ttl + 100, 2);
    put(&mut sh, b"plain-late", 0, 5);
    put(&mut sh, b"plain-early", 0, 3);
    put(&mut sh, b"read", 0, 4);
    sh.get_replica_list(b"read", 6).unwrap(); // lease to 6 + lease_ttl
                                              // A put is a use: within a lease of its put (or of a read) nothing
                                              // is taken from a range without an NVMe tier.
    let mut budget = usize::MAX;
    sh.objs.sweep_pins(50, &mut budget);
    assert_eq!(sh.objs.first_victim(0, 50), None);
    let mut order = Vec::new();
    let now = 50 + ttl;
    let mut budget = usize::MAX;
    assert!(sh.objs.sweep_pins(now, &mut budget));
    while let Some(v) = sh.objs.first_victim(0, now) {
        order.push(sh.objs.key(v).to_vec());
        let r = sh.objs.update(v, |o| o.replicas.remove(0));
        sh.slots[0].as_mut().unwrap().alloc.dealloc(r.offset, 64);
        sh.objs.remove(v);
        sh.check_invariants().expect("kept in step");
    }
    // Unpinned by rank (a lease after the put, or after the read), then
    // soft-pinned by rank.
    let want: Vec<&[u8]> = vec![
        b"plain-early",
        b"plain-late",
        b"read",
        b"pinned-long",
        b"pinned-short",
    ];
    assert_eq!(order, want);

    // A pin that ends moves over only when swept, one per unit of budget.
    put(&mut sh, b"p1", 10, 100 + ttl);
    put(&mut sh, b"p2", 10, 100 + ttl);
    put(&mut sh, b"plain", 0, 150 + ttl);
    let now = 200 + 2 * ttl;
    let mut budget = 1;
    assert!(!sh.objs.sweep_pins(now, &mut budget), "two pins ended");
    sh.check_invariants().expect("kept in step");
    let mut budget = 1;
    assert!(sh.objs.sweep_pins(now, &mut budget));
    // Both pins ended: the two (ties by id) rank before the later put.
    let first = sh.objs.key(sh.objs.first_victim(0, now).unwrap());
    assert!(first == b"p1" || first == b"p2", "{first:?}");
}

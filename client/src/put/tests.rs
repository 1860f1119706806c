//! The put protocol's rules, one input at a time.

use super::*;

const BUDGET: Duration = Duration::from_millis(1000);

fn put(replace: bool) -> PutProtocol {
    let opts = PutOptions {
        replace,
        ..PutOptions::default()
    };
    PutProtocol::new(7, b"k".to_vec(), 4, opts, BUDGET)
}

fn err(code: ErrorCode) -> Result<MasterResponse, KvError> {
    Err(KvError::new(code, "test"))
}

fn replicas() -> Result<MasterResponse, KvError> {
    Ok(MasterResponse::Replicas(Vec::new()))
}

/// The id of a `PutStart`, or a panic naming what came instead.
fn started(a: Action) -> u16 {
    match a {
        Action::Ask(MasterRequest::PutStart { opts, key, len, .. }) => {
            assert_eq!((key.as_slice(), len), (&b"k"[..], 4));
            opts.put_id
        }
        other => panic!("expected a PutStart, got {other:?}"),
    }
}

fn revoked(a: Action) -> u16 {
    match a {
        Action::Ask(MasterRequest::PutRevoke { put_id, .. }) => put_id,
        other => panic!("expected a PutRevoke, got {other:?}"),
    }
}

fn ended(a: Action) -> (u16, Option<u64>) {
    match a {
        Action::Ask(MasterRequest::PutEnd {
            put_id, checksum, ..
        }) => (put_id, checksum),
        other => panic!("expected a PutEnd, got {other:?}"),
    }
}

fn done(a: Action) -> Result<(), KvError> {
    match a {
        Action::Done(r) => r,
        other => panic!("expected the end of the put, got {other:?}"),
    }
}

#[test]
fn a_put_starts_writes_within_half_its_time_and_ends_with_the_checksum_written() {
    let ids = PutIds::default();
    let mut p = put(false);
    let id = started(p.begin(&ids));
    assert_ne!(id, 0);
    let now = Duration::from_millis(100);
    match p.answered(now, &ids, replicas()) {
        Action::Write { by, .. } => assert_eq!(by, Duration::from_millis(550)),
        other => panic!("expected the write, got {other:?}"),
    }
    assert_eq!(ended(p.written(Ok(Some(42)))), (id, Some(42)));
    assert!(done(p.answered(now, &ids, Ok(MasterResponse::Done))).is_ok());
    assert!(p.is_done());
    let late = KvError::new(ErrorCode::Timeout, "late");
    assert_eq!(
        p.revoke_after(&late),
        None,
        "a put that ended well revokes nothing"
    );
}

#[test]
fn a_put_told_to_wait_pauses_1_2_4_8_8_ms_and_names_each_placement_anew() {
    let ids = PutIds::default();
    let mut p = put(false);
    let mut id = started(p.begin(&ids));
    let mut pauses = Vec::new();
    for code in [
        ErrorCode::TryAgain,
        ErrorCode::ReplicaNotReady,
        ErrorCode::TryAgain,
        ErrorCode::TryAgain,
        ErrorCode::TryAgain,
    ] {
        match p.answered(Duration::ZERO, &ids, err(code)) {
            Action::Sleep(d) => pauses.push(d.as_millis()),
            other => panic!("expected a pause, got {other:?}"),
        }
        let next = started(p.woke(&ids));
        assert_ne!(next, id);
        id = next;
    }
    assert_eq!(pauses, [1, 2, 4, 8, 8]);
}

#[test]
fn a_failed_write_revokes_its_placement_reports_the_node_and_places_again_three_times() {
    let ids = PutIds::default();
    let mut p = put(false);
    let mut id = started(p.begin(&ids));
    for placement in 0..=MAX_PLACEMENTS {
        assert!(matches!(
            p.answered(Duration::ZERO, &ids, replicas()),
            Action::Write { .. }
        ));
        let write = Err(KvError::new(ErrorCode::Unavailable, "node gone"));
        assert_eq!(revoked(p.written(write)), id);
        let after = p.answered(Duration::ZERO, &ids, Ok(MasterResponse::Done));
        if placement == MAX_PLACEMENTS {
            let e = done(after).unwrap_err();
            assert_eq!(e.code, ErrorCode::Unavailable);
            return;
        }
        assert!(matches!(after, Action::ReportUnreachable));
        id = started(p.reported(&ids, 1));
    }
    unreachable!("the fourth placement's failure ends the put");
}

#[test]
fn the_last_placement_may_write_until_the_deadline() {
    let ids = PutIds::default();
    let mut p = put(false);
    started(p.begin(&ids));
    for _ in 0..MAX_PLACEMENTS {
        let now = Duration::ZERO;
        assert!(matches!(
            p.answered(now, &ids, err(ErrorCode::Timeout)),
            Action::ReportUnreachable
        ));
        started(p.reported(&ids, 0));
    }
    match p.answered(Duration::from_millis(900), &ids, replicas()) {
        Action::Write { by, .. } => assert_eq!(by, BUDGET),
        other => panic!("expected the write, got {other:?}"),
    }
}

#[test]
fn an_error_with_no_unreachable_node_ends_the_put_with_that_error() {
    let ids = PutIds::default();
    let mut p = put(false);
    started(p.begin(&ids));
    assert!(matches!(
        p.answered(Duration::ZERO, &ids, err(ErrorCode::NoSpace)),
        Action::ReportUnreachable
    ));
    assert_eq!(
        done(p.reported(&ids, 0)).unwrap_err().code,
        ErrorCode::NoSpace
    );
}

#[test]
fn an_unanswered_end_is_sent_again_and_a_key_that_holds_the_value_is_success() {
    let ids = PutIds::default();
    let mut p = put(false);
    let id = started(p.begin(&ids));
    p.answered(Duration::ZERO, &ids, replicas());
    ended(p.written(Ok(None)));
    let mut pauses = Vec::new();
    for _ in 0..3 {
        match p.answered(Duration::ZERO, &ids, err(ErrorCode::Unavailable)) {
            Action::Sleep(d) => pauses.push(d.as_millis()),
            other => panic!("expected a pause, got {other:?}"),
        }
        assert_eq!(ended(p.woke(&ids)), (id, None), "the same placement's end");
    }
    assert_eq!(pauses, [5, 10, 20]);
    let a = p.answered(Duration::ZERO, &ids, err(ErrorCode::ObjectAlreadyExists));
    assert!(matches!(a, Action::ReadBack));
    assert!(done(p.held(&ids, true)).is_ok());
}

#[test]
fn an_end_refused_as_existing_at_the_first_send_is_the_error_not_a_read_back() {
    let ids = PutIds::default();
    let mut p = put(false);
    started(p.begin(&ids));
    p.answered(Duration::ZERO, &ids, replicas());
    ended(p.written(Ok(None)));
    let a = p.answered(Duration::ZERO, &ids, err(ErrorCode::ObjectAlreadyExists));
    // Placement 0, no resend: not this put's own end; the error decides
    // (no unreachable node reported: it is the answer).
    assert!(matches!(a, Action::ReportUnreachable));
    let e = done(p.reported(&ids, 0)).unwrap_err();
    assert_eq!(e.code, ErrorCode::ObjectAlreadyExists);
}

#[test]
fn an_existing_key_after_a_lost_start_answer_revokes_the_earlier_placement_by_its_id() {
    let ids = PutIds::default();
    let mut p = put(false);
    let first = started(p.begin(&ids));
    // The first PutStart's answer was lost (it took effect).
    assert!(matches!(
        p.answered(Duration::ZERO, &ids, err(ErrorCode::Timeout)),
        Action::ReportUnreachable
    ));
    let second = started(p.reported(&ids, 0));
    let a = p.answered(Duration::ZERO, &ids, err(ErrorCode::ObjectAlreadyExists));
    assert!(matches!(a, Action::ReadBack));
    assert_eq!(revoked(p.held(&ids, false)), first);
    let third = started(p.answered(Duration::ZERO, &ids, Ok(MasterResponse::Done)));
    assert!(third != first && third != second);
}

#[test]
fn a_replace_that_meets_an_existing_key_does_not_read_it_back() {
    let ids = PutIds::default();
    let mut p = put(true);
    started(p.begin(&ids));
    p.answered(Duration::ZERO, &ids, err(ErrorCode::Timeout));
    started(p.reported(&ids, 0));
    let a = p.answered(Duration::ZERO, &ids, err(ErrorCode::ObjectAlreadyExists));
    assert!(matches!(a, Action::ReportUnreachable), "got {a:?}");
}

#[test]
fn a_put_the_master_discarded_is_placed_again_then_given_up_as_unavailable() {
    let ids = PutIds::default();
    let mut p = put(false);
    let mut a = p.begin(&ids);
    for _ in 0..MAX_PLACEMENTS {
        started(a);
        a = p.answered(Duration::ZERO, &ids, err(ErrorCode::ObjectNotFound));
    }
    started(a);
    let e = done(p.answered(Duration::ZERO, &ids, err(ErrorCode::ObjectNotFound))).unwrap_err();
    assert_eq!(e.code, ErrorCode::Unavailable);
    assert!(e.message.contains("4 times"), "{}", e.message);
}

#[test]
fn a_put_past_its_deadline_revokes_the_placement_under_way() {
    let ids = PutIds::default();
    let mut p = put(false);
    let id = started(p.begin(&ids));
    p.answered(Duration::ZERO, &ids, replicas());
    let deadline = KvError::new(ErrorCode::Timeout, "the call's deadline");
    let revoke = p.revoke_after(&deadline).expect("a revoke");
    assert_eq!(revoked(Action::Ask(revoke)), id);
    assert!(p.is_done());
    assert_eq!(p.revoke_after(&deadline), None, "once");
}

/// Review of 677b16f: the client before the state machine revoked after
/// any timeout of a put that had named a placement; the first version of
/// the machine only when the deadline cut it short, not when its last
/// placement's start (or end) itself timed out.
#[test]
fn a_put_whose_last_placement_times_out_revokes_that_placement() {
    let ids = PutIds::default();
    let mut p = put(false);
    started(p.begin(&ids));
    for _ in 0..MAX_PLACEMENTS {
        let a = p.answered(Duration::ZERO, &ids, err(ErrorCode::Timeout));
        assert!(matches!(a, Action::ReportUnreachable));
        started(p.reported(&ids, 0));
    }
    let last = p.put_id();
    let e = done(p.answered(Duration::ZERO, &ids, err(ErrorCode::Timeout))).unwrap_err();
    assert_eq!(e.code, ErrorCode::Timeout);
    let revoke = p.revoke_after(&e).expect("the last placement's revoke");
    assert_eq!(revoked(Action::Ask(revoke)), last);
    // Another error than a timeout revokes nothing.
    let mut q = put(false);
    started(q.begin(&ids));
    q.answered(Duration::ZERO, &ids, err(ErrorCode::NoSpace));
    let e = done(q.reported(&ids, 0)).unwrap_err();
    assert_eq!(q.revoke_after(&e), None);
}

#[test]
fn an_input_the_stage_does_not_wait_for_is_an_internal_error_not_a_panic() {
    let ids = PutIds::default();
    let mut p = put(false);
    started(p.begin(&ids));
    let e = done(p.written(Ok(None))).unwrap_err();
    assert_eq!(e.code, ErrorCode::Internal);
    assert!(
        done(p.held(&ids, true)).is_err(),
        "a read-back nobody asked for"
    );
}

#[test]
fn a_batch_round_places_its_items_under_one_id_and_each_item_resends_its_own_lost_end() {
    let round = OneId(41);
    let (mut a, mut b) = (put(false), put(false));
    assert_eq!(started(a.begin(&round)), 41);
    assert_eq!(started(b.begin(&round)), 41, "one BatchPutStart per round");
    let now = Duration::ZERO;
    let next = OneId(42);
    for p in [&mut a, &mut b] {
        let write = p.feed(now, &next, Input::Answer(replicas()));
        assert!(matches!(write, Action::Write { .. }), "{write:?}");
        assert_eq!(
            ended(p.feed(now, &next, Input::Written(Ok(Some(9))))),
            (41, Some(9))
        );
    }
    // The batch end's answer reached `a` (its master shard answered) and not
    // `b` (the other shard's connection broke): only `b` sends its end again,
    // by the same placement's id; `a` is done.
    assert!(done(a.feed(now, &next, Input::Answer(Ok(MasterResponse::Done)))).is_ok());
    let lost = Input::Answer(err(ErrorCode::Unavailable));
    match b.feed(now, &next, lost) {
        Action::Sleep(_) => {}
        other => panic!("expected a pause before the end goes again, got {other:?}"),
    }
    assert_eq!(ended(b.feed(now, &next, Input::Woke)), (41, Some(9)));
    let exists = Input::Answer(err(ErrorCode::ObjectAlreadyExists));
    assert!(matches!(b.feed(now, &next, exists), Action::ReadBack));
    assert!(done(b.feed(now, &next, Input::Held(true))).is_ok());
}

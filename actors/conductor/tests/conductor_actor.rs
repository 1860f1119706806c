//! The live Conductor actor, driven with real messages.

use std::time::Duration;

use kvpool_conductor::actor::{
    ConductorArgs, ConductorError, ConductorHandle, ConductorMsg, InstanceKind, InstanceLoad,
    KvLocation, ScheduleRequest,
};
use kvpool_conductor::chunk_hash::{chunk_hashes, ChunkHash};
use kvpool_conductor::cost::CostModel;
use kvpool_conductor::scheduler::{Decision, Policy, RejectReason, Slo};

const T: Duration = Duration::from_secs(10);

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ seed)
        .collect()
}

fn request(id: u64, tokens: &[u32]) -> ScheduleRequest {
    ScheduleRequest {
        id,
        input_tokens: tokens.len() as u32,
        chunks: chunk_hashes(tokens, 512).unwrap(),
        pool_prefix_blocks: None,
    }
}

fn idle_reports(h: &ConductorHandle, prefill: usize, decode: usize) {
    for i in 0..prefill {
        h.report_load(
            i,
            InstanceLoad::Prefill {
                queued_requests: 0,
                queued_ms: 0.0,
            },
        )
        .unwrap();
    }
    for i in 0..decode {
        h.report_load(
            i,
            InstanceLoad::Decode {
                active_seqs: 0,
                active_tokens: 0,
                waiting_seqs: 0,
                waiting_tokens: 0,
            },
        )
        .unwrap();
    }
}

fn routed(d: Decision) -> (usize, usize, usize, usize) {
    match d {
        Decision::Route {
            prefill,
            decode,
            cached_blocks,
            fetched_blocks,
            ..
        } => (prefill, decode, cached_blocks, fetched_blocks),
        Decision::Reject(r) => panic!("rejected: {r}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_goes_to_the_instance_that_reported_its_prefix() {
    let args = ConductorArgs::new(
        Policy::CacheGlobal,
        CostModel::default(),
        Slo::default(),
        4,
        2,
    );
    let (h, join) = ConductorHandle::spawn(args).await.unwrap();
    idle_reports(&h, 4, 2);

    // Instance 2 stored the first 16 chunks of a conversation; instance 0
    // stored an unrelated prompt.
    let conv = prompt(1, 16 * 512);
    let other = prompt(2, 16 * 512);
    h.kv_event(
        KvLocation::Prefill(2),
        chunk_hashes(&conv, 512).unwrap(),
        Vec::new(),
    )
    .unwrap();
    h.kv_event(
        KvLocation::Prefill(0),
        chunk_hashes(&other, 512).unwrap(),
        Vec::new(),
    )
    .unwrap();

    let mut next_turn = conv.clone();
    next_turn.extend(prompt(3, 2_000));
    let (p, _, cached, fetched) = routed(h.schedule(request(1, &next_turn), T).await.unwrap());
    assert_eq!((p, cached, fetched), (2, 16, 0));

    // Instance 2 becomes busy for a minute: the same prefix is now cheaper to
    // fetch from the pool onto an idle instance.
    h.kv_event(
        KvLocation::Pool,
        chunk_hashes(&conv, 512).unwrap(),
        Vec::new(),
    )
    .unwrap();
    h.report_load(
        2,
        InstanceLoad::Prefill {
            queued_requests: 30,
            queued_ms: 60_000.0,
        },
    )
    .unwrap();
    let (p, _, cached, fetched) = routed(h.schedule(request(2, &next_turn), T).await.unwrap());
    assert_ne!(p, 2);
    assert_eq!((cached, fetched), (16, 16));

    // The conductor counts the routed request in that instance's queue and
    // expects the instance to hold the request's 19 full chunks from now on.
    let snap = h.snapshot(T).await.unwrap();
    let (load, mirrored) = snap.prefill[p];
    assert_eq!(load.queued, 1);
    assert!(load.busy_until_ms > snap.now_ms);
    assert!(mirrored >= 19, "{mirrored}");

    // Removal events are honoured: with the chunks gone from the pool and
    // from that instance, and instance 2 still busy, the request is computed
    // from scratch on some idle instance.
    let turn_chunks: Vec<ChunkHash> = chunk_hashes(&next_turn, 512).unwrap();
    h.kv_event(KvLocation::Pool, Vec::new(), turn_chunks.clone())
        .unwrap();
    h.kv_event(KvLocation::Prefill(p), Vec::new(), turn_chunks)
        .unwrap();
    let (p3, _, cached, _) = routed(h.schedule(request(3, &next_turn), T).await.unwrap());
    assert_ne!(p3, 2);
    assert_eq!(cached, 0);

    let snap = h.snapshot(T).await.unwrap();
    assert_eq!(snap.routed, 3);
    assert_eq!(snap.rejected, 0);
    assert_eq!(snap.prefill.len(), 4);
    assert_eq!(snap.pool_chunks, 0);
    h.stop();
    join.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_pool_and_load_reports_drive_rejection() {
    let cost = CostModel::default();
    let cap = cost.decode.max_context_tokens;
    let args = ConductorArgs::new(Policy::EarlyReject, cost, Slo::default(), 2, 2);
    let (h, join) = ConductorHandle::spawn(args).await.unwrap();
    idle_reports(&h, 2, 2);
    let p = prompt(9, 4_096);
    let (_, d, _, _) = routed(h.schedule(request(1, &p), T).await.unwrap());
    assert!(d < 2);
    // Decode instance 0 overloaded: requests go to decode instance 1.
    let full = InstanceLoad::Decode {
        active_seqs: 200,
        active_tokens: cap,
        waiting_seqs: 100,
        waiting_tokens: cap,
    };
    h.report_load(0, full).unwrap();
    let (_, d, _, _) = routed(h.schedule(request(2, &p), T).await.unwrap());
    assert_eq!(d, 1);
    // Both overloaded: rejected before any prefill, with a clear reason.
    h.report_load(1, full).unwrap();
    match h.schedule(request(3, &p), T).await.unwrap() {
        Decision::Reject(r @ RejectReason::TbtSlo { .. }) => {
            assert!(r.to_string().contains("exceeds"), "{r}");
        }
        other => panic!("expected a TBT rejection, got {other:?}"),
    }
    // Reports for instances that do not exist are counted and ignored.
    h.report_load(7, full).unwrap();
    h.kv_event(KvLocation::Prefill(9), Vec::new(), Vec::new())
        .unwrap();
    let snap = h.snapshot(T).await.unwrap();
    assert_eq!(snap.ignored, 2);
    assert_eq!(snap.rejected, 1);
    h.stop();
    join.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_requests_teach_predictive_reject_how_long_answers_are() {
    // Prefill is 20 s behind; decode is half full. Requests routed now all
    // reach decode 20 s later; how many fit depends on how much of today's
    // batch has finished by then, so on how long answers are.
    async fn admitted(answers: Option<u32>) -> usize {
        let cost = CostModel::default();
        let cap = cost.decode.max_context_tokens;
        let args = ConductorArgs::new(Policy::PredictiveReject, cost, Slo::default(), 1, 1);
        let (h, join) = ConductorHandle::spawn(args).await.unwrap();
        h.report_load(
            0,
            InstanceLoad::Prefill {
                queued_requests: 10,
                queued_ms: 20_000.0,
            },
        )
        .unwrap();
        h.report_load(
            0,
            InstanceLoad::Decode {
                active_seqs: 50,
                active_tokens: cap / 2,
                waiting_seqs: 0,
                waiting_tokens: 0,
            },
        )
        .unwrap();
        if let Some(tokens) = answers {
            for _ in 0..10 {
                h.decode_finished(0, tokens).unwrap();
            }
            // A report from a decode instance the conductor does not have.
            h.decode_finished(5, tokens).unwrap();
            let snap = h.snapshot(T).await.unwrap();
            assert_eq!(snap.expected_output_tokens, f64::from(tokens));
            assert_eq!(snap.ignored, 1);
        }
        // Long prompts: their KV, not the prefill queue's bound, runs out.
        let p = prompt(3, 16_384);
        for n in 0..10_000 {
            match h.schedule(request(n, &p), T).await.unwrap() {
                Decision::Route { .. } => {}
                Decision::Reject(RejectReason::TbtSlo { .. }) => {
                    h.stop();
                    join.await.unwrap();
                    return n as usize;
                }
                other => panic!("expected a route or a TBT rejection, got {other:?}"),
            }
        }
        panic!("never refused");
    }
    // The configured 150-token answers, then 2,000-token ones learned.
    let short = admitted(None).await;
    let long = admitted(Some(2_000)).await;
    assert!(
        long < short,
        "{long} admitted with long answers, {short} with short ones"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handle_bounds_the_mailbox_and_raw_messages_work() {
    let mut args = ConductorArgs::new(
        Policy::CacheGlobal,
        CostModel::default(),
        Slo::default(),
        1,
        1,
    );
    args.mailbox_bound = 1;
    let (h, join) = ConductorHandle::spawn(args).await.unwrap();
    // Raw sends through the ActorRef bypass the bound but are handled.
    let reply = h
        .actor()
        .call(
            |reply| ConductorMsg::Schedule {
                request: request(1, &prompt(4, 1_024)),
                reply,
            },
            Some(T),
        )
        .await
        .unwrap();
    assert!(reply.is_success());
    // Fill the single slot faster than the actor drains it: some sends are
    // refused with Overloaded, none is lost silently.
    let mut refused = 0;
    for i in 0..10_000 {
        match h.report_load(
            0,
            InstanceLoad::Prefill {
                queued_requests: i,
                queued_ms: 0.0,
            },
        ) {
            Ok(()) => {}
            Err(ConductorError::Overloaded { bound }) => {
                assert_eq!(bound, 1);
                refused += 1;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(refused > 0);
    // Once drained, the handle works again.
    let mut snap = None;
    for _ in 0..100 {
        match h.snapshot(T).await {
            Ok(s) => {
                snap = Some(s);
                break;
            }
            Err(ConductorError::Overloaded { .. }) => {
                tokio::time::sleep(Duration::from_millis(5)).await
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(snap.is_some());
    assert!(h.outstanding() <= 1);
    h.stop();
    join.await.unwrap();
    // After stop, sends fail with a clear error.
    let err = h.report_load(
        0,
        InstanceLoad::Prefill {
            queued_requests: 0,
            queued_ms: 0.0,
        },
    );
    assert!(matches!(err, Err(ConductorError::NotRunning(_))), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_are_refused_at_spawn() {
    let args = ConductorArgs::new(
        Policy::CacheGlobal,
        CostModel::default(),
        Slo::default(),
        0,
        1,
    );
    assert!(matches!(
        ConductorHandle::spawn(args).await,
        Err(ConductorError::InvalidArgs(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn availability_the_pools_prefix_and_the_decision_log() {
    let dir = std::env::temp_dir().join(format!("kvpool-conductor-log-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("decisions.jsonl");
    let mut args = ConductorArgs::new(
        Policy::CacheGlobal,
        CostModel::default(),
        Slo::default(),
        2,
        2,
    );
    args.decision_log = Some(log.clone());
    let (h, join) = ConductorHandle::spawn(args).await.unwrap();
    idle_reports(&h, 2, 2);
    let tokens = prompt(5, 8 * 512);

    // The caller says the pool holds 6 of the 8 chunks: the conductor's own
    // mirror knows none of them.
    let mut r = request(1, &tokens);
    r.pool_prefix_blocks = Some(6);
    let (_, _, cached, fetched) = routed(h.schedule(r, T).await.unwrap());
    assert_eq!((cached, fetched), (6, 6));

    // Prefill 0 and decode 0 go down: everything goes to instance 1.
    h.set_available(InstanceKind::Prefill, 0, false).unwrap();
    h.set_available(InstanceKind::Decode, 0, false).unwrap();
    for id in 2..6 {
        let (p, d, _, _) = routed(h.schedule(request(id, &tokens), T).await.unwrap());
        assert_eq!((p, d), (1, 1));
    }
    assert_eq!(h.pick_decode(1000, T).await.unwrap(), Some(1));
    h.decode_finished(1, 40).unwrap();
    // Nothing up on the decode side: refused, and no decode to pick.
    h.set_available(InstanceKind::Decode, 1, false).unwrap();
    assert_eq!(
        h.schedule(request(9, &tokens), T).await.unwrap(),
        Decision::Reject(RejectReason::NoInstances)
    );
    assert_eq!(h.pick_decode(1000, T).await.unwrap(), None);
    let snap = h.snapshot(T).await.unwrap();
    assert_eq!(snap.prefill_up, vec![false, true]);
    assert_eq!(snap.decode_up, vec![false, false]);
    h.stop();
    join.await.unwrap();

    // The log holds every decision with its view, and replays.
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(text.lines().count(), 1 + 6 + 1, "{text}");
    let r = kvpool_conductor::record::replay(text.as_bytes()).unwrap();
    assert_eq!((r.decisions, r.agreed, r.rejected), (6, 6, 1));
    let _ = std::fs::remove_dir_all(&dir);
}

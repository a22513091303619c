//! Unit tests of the shared state: the waiting map and the core must agree about every job.

use super::*;
use crate::config::Config;

/// A gate with one slot and a best-effort class, in front of an upstream never contacted.
fn shared() -> Arc<Shared> {
    let cfg = Config::from_toml(
        r#"
        default_class = "batch"
        [[pools]]
        name = "default"
        slots = 1
        upstream = "http://127.0.0.1:9"
        [[classes]]
        name = "batch"
        priority = 10
        "#,
    );
    let cfg = cfg.map_err(|e| e.to_string());
    assert!(cfg.is_ok(), "{cfg:?}");
    let shared = cfg.and_then(|c| Shared::new(&c, DecisionLog::off()).map_err(String::from));
    match shared {
        Ok(s) => Arc::new(s),
        Err(e) => panic!("{e}"),
    }
}

fn request() -> Request {
    Request {
        class: None,
        deadline: None,
        first_token_deadline: None,
        prompt_tokens: 4,
        max_tokens: Some(4),
        deadline_is_absolute: false,
        ..Request::default()
    }
}

fn queue(s: &Arc<Shared>) -> (oneshot::Receiver<Signal>, JobGuard) {
    match s.admit_labeled(None, request(), JobMeta::default()) {
        Admission::Queued { signal, guard, .. } => (signal, guard),
        Admission::Rejected(d, _) => panic!("rejected: {d:?}"),
        Admission::NotLeader => panic!("not leader"),
    }
}

fn pool(s: &Shared) -> (u32, u32) {
    let snap = s.snapshot();
    (snap.pools[0].in_flight, snap.pools[0].depth)
}

#[test]
fn dispatch_of_a_job_nobody_waits_for_frees_its_slot() {
    let s = shared();
    let (mut first_rx, first) = queue(&s);
    assert!(matches!(first_rx.try_recv(), Ok(Signal::Go(_))));
    let (_second_rx, second) = queue(&s);
    assert_eq!(pool(&s), (1, 1));
    // The second request's waiter vanishes without the core hearing of it.
    let second_id = second.id();
    s.with_core(|st, _, _| st.waiting.remove(&second_id));
    std::mem::forget(second);
    first.finish(Outcome {
        ok: true,
        status: 200,
        ..Outcome::default()
    });
    // The slot went to the second job, which nobody waits for: it must be given back.
    assert_eq!(pool(&s), (0, 0), "slot leaked to a job without a waiter");
}

#[test]
fn finishing_a_job_the_core_did_not_end_keeps_its_waiter() {
    let s = shared();
    let (_first_rx, first) = queue(&s);
    let (mut second_rx, second) = queue(&s);
    // Completing a job that is still queued ends nothing in the core ...
    s.end(
        second.id(),
        Some(Outcome::default()),
        0,
        Reason::ClientCancelled,
        None,
    );
    assert_eq!(pool(&s), (1, 1));
    // ... so its waiter must still be there to hear about its dispatch.
    first.finish(Outcome {
        ok: true,
        status: 200,
        ..Outcome::default()
    });
    assert!(matches!(second_rx.try_recv(), Ok(Signal::Go(_))));
    assert_eq!(pool(&s), (1, 0));
    drop(second);
    assert_eq!(pool(&s), (0, 0));
}

#[test]
fn lines_are_numbered_in_the_order_the_core_decided() {
    let s = shared();
    let mut seen = Vec::new();
    let (_rx, guard) = queue(&s);
    s.with_core(|st, _, _| seen.push(st.seq));
    s.log_error(Reason::InvalidJson, 400, "/v1/chat/completions", None);
    s.with_core(|st, _, _| seen.push(st.seq));
    drop(guard);
    s.with_core(|st, _, _| seen.push(st.seq));
    // admit + dispatch, then one error line, then one cancel line.
    assert_eq!(seen, vec![2, 3, 4]);
}

/// The label a replica deciding alone reads (for its class's fail mode) is the label the core
/// classifies: padded, it is the same class; one character past the longest class name, it
/// is no class (the default). The cluster once kept its own copy of the label reader, which
/// neither trimmed nor cut where the core's did: a padded `interactive` found the default
/// class's fail mode, and a label longer than a 64-character class name found that class.
#[test]
fn a_replica_alone_reads_the_fail_mode_of_the_class_the_core_classifies() {
    let long_name = "c".repeat(64);
    let cfg = Config::from_toml(&format!(
        r#"
        default_class = "batch"
        [[pools]]
        name = "default"
        slots = 1
        upstream = "http://127.0.0.1:9"
        [[classes]]
        name = "interactive"
        priority = 100
        fail_mode = "open"
        [[classes]]
        name = "{long_name}"
        priority = 50
        fail_mode = "open"
        [[classes]]
        name = "batch"
        priority = 10
        fail_mode = "closed"
        "#
    ));
    let shared = match cfg
        .map_err(|e| e.to_string())
        .and_then(|c| Shared::new(&c, DecisionLog::off()).map_err(String::from))
    {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    };
    let mode = |label: &str| {
        let mut h = http::HeaderMap::new();
        match http::HeaderValue::from_str(label) {
            Ok(v) => h.insert("x-job-class", v),
            Err(e) => panic!("{e}"),
        };
        shared.fail_mode(crate::wire::request_info::class_label(&h).as_deref())
    };
    use slackgate_core::FailMode;
    assert_eq!(mode("interactive"), FailMode::Open);
    assert_eq!(mode(" interactive\t"), FailMode::Open);
    assert_eq!(mode(&long_name), FailMode::Open);
    assert_eq!(mode(&format!("{long_name}x")), FailMode::Closed);
    assert_eq!(mode("   "), FailMode::Closed);
}

/// Fencing: a request the cluster routed here to be decided as leader is not decided once
/// this replica does not lead (here: no lease at all): nothing enters the core, no slot, no
/// hold, no log line; it goes where the lease is now.
#[test]
fn a_request_routed_as_leader_to_a_replica_that_does_not_lead_is_not_decided() {
    let s = shared();
    let meta = JobMeta {
        routed_as_leader: true,
        ..JobMeta::default()
    };
    assert!(matches!(
        s.admit_labeled(None, request(), meta),
        Admission::NotLeader
    ));
    assert_eq!(pool(&s), (0, 0));
    assert_eq!(s.with_core(|st, _, _| st.gate.ledger_stats().held), 0);
}

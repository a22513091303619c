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
    let shared = cfg.and_then(|c| Shared::new(&c, DecisionLog::off()));
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

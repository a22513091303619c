//! Headroom: best-effort work of a lower class leaves slots free for the class above.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::tests::{cfg, drain, req};
use super::*;
use crate::config::Headroom;

/// Four slots of 100 ms requests; `prod` (priority 100, 4 s deadline) above `probe`
/// (priority 10, best effort, no queue-age limit) with the given headroom.
fn gate(headroom: Headroom) -> Gate {
    let mut c = cfg(4, 100.0);
    c.pools[0].headroom = headroom;
    c.classes[1].max_queue_age_ms = None;
    Gate::new(c).unwrap()
}

fn keyed(g: &Gate, label: &str, key: &str) -> Request {
    Request {
        idempotency_key: Some(key.into()),
        ..req(g, label)
    }
}

fn dispatched(ev: &[Event]) -> Vec<(JobId, Option<u64>)> {
    ev.iter()
        .filter_map(|e| match e {
            Event::Dispatch {
                job_id, held_ms, ..
            } => Some((*job_id, *held_ms)),
            _ => None,
        })
        .collect()
}

#[test]
fn best_effort_work_leaves_the_pinned_headroom_free_for_the_class_above() {
    let mut g = gate(Headroom::Slots(1));
    let probes: Vec<_> = (0..4)
        .map(|i| g.offer(0, keyed(&g, "probe", &format!("p{i}"))))
        .collect();
    assert!(probes.iter().all(|d| d.action == Action::Admit));
    // Three start; the fourth would take the last slot, kept for prod.
    assert_eq!(dispatched(&drain(&mut g, 0)).len(), 3);
    let snap = g.snapshot(0);
    assert_eq!(
        (
            snap.pools[0].headroom_slots,
            snap.pools[0].headroom_reserved_slots
        ),
        (1, 1)
    );
    // A prod request arriving now finds its slot free: no wait, started at once.
    let d = g.offer(10, keyed(&g, "prod", "q"));
    assert_eq!((d.action, d.projected_wait_ms), (Action::Admit, 0));
    assert_eq!(dispatched(&drain(&mut g, 10)), vec![(d.job_id, None)]);
    // When a probe ends, the held one starts (prod's running job is the headroom in use),
    // and its dispatch says how long it was held with a slot free.
    g.on_complete(100, probes[0].job_id, Completion::default());
    assert_eq!(
        dispatched(&drain(&mut g, 100)),
        vec![(probes[3].job_id, Some(100))]
    );
}

#[test]
fn without_headroom_best_effort_work_takes_every_slot_and_the_class_above_waits() {
    // The failure the headroom fixes: the same arrivals, headroom off.
    let mut g = gate(Headroom::Off);
    for i in 0..4 {
        g.offer(0, keyed(&g, "probe", &format!("p{i}")));
    }
    assert_eq!(dispatched(&drain(&mut g, 0)).len(), 4);
    let d = g.offer(10, keyed(&g, "prod", "q"));
    assert_eq!(d.action, Action::Admit);
    assert!(d.projected_wait_ms > 0, "{d:?}");
    assert!(dispatched(&drain(&mut g, 10)).is_empty());
}

#[test]
fn the_learned_headroom_follows_the_demand_of_the_class_above() {
    let mut g = gate(Headroom::Learned);
    // Nothing asked above yet: no headroom, best-effort work takes every slot.
    assert_eq!(g.snapshot(0).pools[0].headroom_slots, 0);
    for i in 0..4 {
        g.offer(0, keyed(&g, "probe", &format!("a{i}")));
    }
    let first = dispatched(&drain(&mut g, 0));
    assert_eq!(first.len(), 4);
    for (id, _) in first {
        g.on_complete(100, id, Completion::default());
    }
    drain(&mut g, 100);
    // prod asks for about two slots' worth over a while: 2 requests of 100 ms every 100 ms.
    let mut t = 100;
    for i in 0..40 {
        for j in 0..2 {
            let d = g.offer(t, keyed(&g, "prod", &format!("q{i}-{j}")));
            assert_eq!(d.action, Action::Admit);
        }
        let started = dispatched(&drain(&mut g, t));
        t += 100;
        for (id, _) in started {
            g.on_complete(t, id, Completion::default());
        }
        drain(&mut g, t);
    }
    let kept = g.snapshot(t).pools[0].headroom_slots;
    assert!((1..=3).contains(&kept), "headroom {kept}");
    // Best-effort work now starts on the slots past it only.
    for i in 0..4 {
        g.offer(t, keyed(&g, "probe", &format!("b{i}")));
    }
    assert_eq!(dispatched(&drain(&mut g, t)).len(), 4 - kept as usize);
}

#[test]
fn work_with_a_deadline_and_the_top_class_are_never_held() {
    // A lower class with a deadline was promised its wait on the slots as they are.
    let mut c = cfg(4, 100.0);
    c.pools[0].headroom = Headroom::Slots(3);
    c.classes[1].deadline_ms = Some(60_000);
    let mut g = Gate::new(c).unwrap();
    for i in 0..4 {
        assert_eq!(
            g.offer(0, keyed(&g, "probe", &format!("p{i}"))).action,
            Action::Admit
        );
    }
    assert_eq!(dispatched(&drain(&mut g, 0)).len(), 4);
    // The top class has nothing above it.
    let mut g = gate(Headroom::Slots(3));
    for i in 0..4 {
        g.offer(0, keyed(&g, "prod", &format!("q{i}")));
    }
    assert_eq!(dispatched(&drain(&mut g, 0)).len(), 4);
}

#[test]
fn a_gate_that_only_watches_holds_nothing_back() {
    for (admit_always, shadow) in [(true, false), (false, true)] {
        let mut c = cfg(4, 100.0);
        c.pools[0].headroom = Headroom::Slots(2);
        c.classes[1].max_queue_age_ms = None;
        c.admit_always = admit_always;
        c.shadow = shadow;
        let mut g = Gate::new(c).unwrap();
        for i in 0..4 {
            g.offer(0, keyed(&g, "probe", &format!("p{i}")));
        }
        assert_eq!(dispatched(&drain(&mut g, 0)).len(), 4);
    }
}

#[test]
fn a_pinned_headroom_must_leave_lower_classes_a_slot() {
    let mut c = cfg(4, 100.0);
    c.pools[0].headroom = Headroom::Slots(4);
    let e = c.validate().err().map(|e| e.path);
    assert_eq!(e, Some("pools[0].headroom".to_string()));
    c.pools[0].headroom = Headroom::Slots(3);
    assert_eq!(c.validate(), Ok(()));
}

#[test]
fn held_best_effort_work_does_not_block_work_with_a_deadline_below_it() {
    // prod (100) > probe (50, best effort, held) > nightly (10, 60 s deadline, never held).
    let mut c = cfg(4, 100.0);
    c.pools[0].headroom = Headroom::Slots(1);
    c.classes[1].max_queue_age_ms = None;
    c.classes[1].priority = 50;
    c.classes.push(crate::config::ClassConfig {
        name: "nightly".into(),
        priority: 10,
        deadline_ms: Some(60_000),
        pool: "free".into(),
        ..crate::config::ClassConfig::default()
    });
    let mut g = Gate::new(c).unwrap();
    for i in 0..4 {
        g.offer(0, keyed(&g, "probe", &format!("p{i}")));
    }
    assert_eq!(dispatched(&drain(&mut g, 0)).len(), 3, "the fourth is held");
    // A nightly request (its projection counts the held job ahead of it, the conservative
    // side) starts now on the free slot, past the held probe, instead of waiting behind it.
    let e = g.offer(1, keyed(&g, "nightly", "e"));
    assert_eq!(e.action, Action::Admit);
    assert_eq!(dispatched(&drain(&mut g, 1)), vec![(e.job_id, None)]);
}

#[test]
fn a_neighbours_load_never_holds_best_effort_work() {
    // The server's gauges say neighbours run on every slot the gate does not use: the gate
    // still counts its own slots for the headroom (as it does for what it sends), so the
    // best-effort work is not held forever on a reading.
    let mut g = gate(Headroom::Slots(1));
    g.set_server_reading(0, PoolId(0), 0, Some((4, 0)), 500);
    let d = g.offer(0, keyed(&g, "probe", "p"));
    assert_eq!(d.action, Action::Admit);
    assert_eq!(dispatched(&drain(&mut g, 0)), vec![(d.job_id, None)]);
}

#[test]
fn a_pinned_headroom_keeps_nothing_for_a_disabled_class() {
    let mut c = cfg(4, 100.0);
    c.pools[0].headroom = Headroom::Slots(2);
    c.classes[0].enabled = false;
    c.classes[1].max_queue_age_ms = None;
    let mut g = Gate::new(c).unwrap();
    for i in 0..4 {
        g.offer(0, keyed(&g, "probe", &format!("p{i}")));
    }
    assert_eq!(dispatched(&drain(&mut g, 0)).len(), 4);
}

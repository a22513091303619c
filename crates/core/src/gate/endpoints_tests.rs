//! Hand-computed cases for endpoints: placement, ejection and drains, a provider's 429, the
//! server's own queue, and reloads. Every job costs a fixed 1000 ms (frozen estimator, no
//! per-token cost, no batch slowdown) unless a test says otherwise.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::tests::{cfg, drain, req};
use super::*;
use crate::config::EndpointConfig;

const P: PoolId = PoolId(0);

fn ep(name: &str, slots: u32) -> EndpointConfig {
    EndpointConfig {
        name: name.into(),
        url: format!("http://{name}.test:8000"),
        slots,
    }
}

/// `cfg` with the pool's servers given as endpoints.
fn with_endpoints(endpoints: Vec<EndpointConfig>) -> GateConfig {
    let mut c = cfg(1, 1000.0);
    c.pools[0].endpoints = endpoints;
    c
}

fn dispatched(events: &[Event]) -> Vec<(JobId, usize)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Dispatch {
                job_id, endpoint, ..
            } => Some((*job_id, *endpoint)),
            _ => None,
        })
        .collect()
}

fn ok() -> Completion {
    Completion {
        ok: true,
        ..Completion::default()
    }
}

#[test]
fn dispatch_spreads_over_endpoints_within_each_ones_slots() {
    // a has 2 slots, b has 1: the pool has 3.
    let mut g = Gate::new(with_endpoints(vec![ep("a", 2), ep("b", 1)])).unwrap();
    assert_eq!(g.snapshot(0).pools[0].slots, 3);
    let mut placed = Vec::new();
    for _ in 0..3 {
        let d = g.offer(0, req(&g, "prod"));
        assert_eq!(d.action, Action::Admit);
        placed.extend(dispatched(&drain(&mut g, 0)).into_iter().map(|(_, e)| e));
    }
    // Equal speed and no batch slowdown: the least loaded by share of its slots, then the
    // first. a (0/2) ties b (0/1) -> a; a 1/2 vs b 0/1 -> b; a 1/2 vs b full -> a. A fourth
    // waits: every slot holds 1000 ms of work, so its projected wait is 1000.
    assert_eq!(placed, vec![0, 1, 0]);
    let v = g.endpoints(0, P);
    assert_eq!((v[0].in_flight, v[1].in_flight), (2, 1));
    let d = g.offer(0, req(&g, "prod"));
    assert_eq!(d.projected_wait_ms, 1000);
}

#[test]
fn an_ejected_or_drained_endpoint_takes_no_new_work_and_its_running_work_ends() {
    let mut g = Gate::new(with_endpoints(vec![ep("a", 1), ep("b", 1)])).unwrap();
    for _ in 0..3 {
        g.offer(0, req(&g, "prod"));
    }
    let first = dispatched(&drain(&mut g, 0));
    assert_eq!(first, vec![(JobId(1), 0), (JobId(2), 1)]);
    // b fails its health checks: capacity 1, its running job goes on.
    assert!(g.set_endpoint_ejected(100, P, 1, true));
    assert!(
        !g.set_endpoint_ejected(100, P, 1, true),
        "no change the second time"
    );
    assert_eq!(g.snapshot(100).pools[0].slots, 1);
    // b's job ends first; the queued job still waits for a, not for b.
    g.on_complete(500, JobId(2), ok()).unwrap();
    assert!(dispatched(&drain(&mut g, 500)).is_empty());
    g.on_complete(1000, JobId(1), ok()).unwrap();
    assert_eq!(dispatched(&drain(&mut g, 1000)), vec![(JobId(3), 0)]);

    // a drained as well: no endpoint left. A request with a deadline is refused at once
    // (a capacity refusal, so a retry hint applies), with the floor as Retry-After; work
    // without a deadline queues for an endpoint to return.
    assert!(g.set_endpoint_draining(1000, P, 0, true));
    let d = g.offer(1000, req(&g, "prod"));
    assert_eq!(
        (d.action, d.reason),
        (Action::Reject, Reason::UpstreamUnavailable)
    );
    assert!(d.should_retry);
    assert!((1000..=1200).contains(&d.retry_after_ms.unwrap_or(0)));
    let d = g.offer(1000, req(&g, "probe"));
    assert_eq!(d.action, Action::Admit);
    let probe = d.job_id;
    assert!(dispatched(&drain(&mut g, 1000)).is_empty());
    // A tick does not drop queued work for want of an endpoint.
    g.tick(1500);
    assert!(drain(&mut g, 1500).is_empty());
    // b is readmitted: the queued job goes there.
    assert!(g.set_endpoint_ejected(2000, P, 1, false));
    assert_eq!(dispatched(&drain(&mut g, 2000)), vec![(probe, 1)]);
    // a's drained job (3) still ends normally.
    assert!(g.on_complete(2000, JobId(3), ok()).is_some());
    assert_eq!(g.endpoints(2000, P)[0].in_flight, 0);
}

#[test]
fn a_provider_429_pauses_the_endpoint_and_halves_its_slots() {
    let mut g = Gate::new(with_endpoints(vec![ep("api", 4)])).unwrap();
    g.offer(0, req(&g, "prod"));
    g.offer(0, req(&g, "prod"));
    assert_eq!(dispatched(&drain(&mut g, 0)).len(), 2);
    // At 100 the provider says: come back in 3000 ms. Slots in force: half of 4 = 2;
    // nothing starts before 3100.
    assert_eq!(g.throttled(100, P, 0, Some(3000)), (3000, true));
    let v = &g.endpoints(100, P)[0];
    assert_eq!((v.limit, v.paused_ms), (2, 3000));
    // A newcomer: both slots in force free at max(their jobs' 900 ms left, the pause's 3000)
    // = 3000. Its deadline (4000 from 100) leaves 4000 - 1000 = 3000 of slack: it fits
    // exactly.
    let d = g.offer(100, req(&g, "prod"));
    assert_eq!((d.action, d.projected_wait_ms), (Action::Admit, 3000));
    // The running jobs end at 1000: still paused, nothing starts, the limit stays at 2.
    g.on_complete(1000, JobId(1), ok()).unwrap();
    g.on_complete(1000, JobId(2), ok()).unwrap();
    assert!(dispatched(&drain(&mut g, 1000)).is_empty());
    assert_eq!(g.endpoints(1000, P)[0].limit, 2);
    // The pause passes: the queued job starts; its completion grows the limit back by one.
    assert_eq!(dispatched(&drain(&mut g, 3100)), vec![(JobId(3), 0)]);
    g.on_complete(4100, JobId(3), ok()).unwrap();
    assert_eq!(g.endpoints(4100, P)[0].limit, 3);
    // Throttled with nothing in flight: halved all the same, never below one.
    for t in [4200, 4300, 4400] {
        g.throttled(t, P, 0, Some(10));
    }
    assert_eq!(g.endpoints(4400, P)[0].limit, 1);
}

#[test]
fn the_servers_own_queue_counts_neighbours_work() {
    let mut g = Gate::new(with_endpoints(vec![ep("llama", 4)])).unwrap();
    // The server runs 2 requests the gate did not send (it has none in flight yet).
    g.set_server_reading(0, P, 0, Some((2, 0)), 500);
    assert_eq!(g.endpoints(0, P)[0].outside_running, 2);
    // The gate's own slots decide what it sends (neighbours never hold it back: the
    // server's queue is first come, first served): three start.
    for _ in 0..3 {
        g.offer(0, req(&g, "prod"));
    }
    assert_eq!(dispatched(&drain(&mut g, 0)).len(), 3);
    // The projection counts the neighbours: a neighbour's request is taken to last the
    // pool's mean service (nothing completed yet: the prior's 1000 ms). Five requests hold
    // the four slots, each for 1000 ms: the next waits 1000 as things stand. The neighbours
    // hold half of the server now and are taken to keep arriving while it waits: the
    // forecast doubles the wait, 1000 / (1 - 0.5) = 2000.
    let d = g.offer(0, req(&g, "prod"));
    assert_eq!(d.projected_wait_ms - d.forecast_wait_ms, 1000);
    assert_eq!((d.action, d.projected_wait_ms), (Action::Admit, 2000));
    assert_eq!(dispatched(&drain(&mut g, 0)).len(), 1);
    // Now the server reports 4 running and 6 waiting; 4 of those 10 are the gate's, so 6
    // are the neighbours': 4 running (taken to run first) and 2 waiting, who start before
    // anything the gate sends next: 2 x 1000 ms over four slots that free at 1000, 1000 +
    // 2000 / 4 = 1500 as things stand; they ask for the whole server, so the forecast is at
    // its cap (rho 0.98: 1500 / 0.02 = 75000).
    g.set_server_reading(0, P, 0, Some((4, 6)), 500);
    let v = &g.endpoints(0, P)[0];
    assert_eq!((v.outside_running, v.outside_waiting), (4, 2));
    let d = g.offer(0, req(&g, "prod"));
    assert_eq!(d.projected_wait_ms - d.forecast_wait_ms, 1500);
    assert_eq!(d.projected_wait_ms, 75_000);
    // A gauge off the network far beyond the server is capped at its slots.
    g.set_server_reading(0, P, 0, Some((u32::MAX, u32::MAX)), 500);
    let v = &g.endpoints(0, P)[0];
    assert_eq!((v.outside_running, v.outside_waiting), (4, 0));
    // The reading goes stale (no newer one within its 500 ms): back to the gate's own view,
    // where the four slots are the gate's four jobs: the next waits for one of them.
    g.tick(499);
    assert!(g.endpoints(499, P)[0].signal);
    g.tick(500);
    assert!(!g.endpoints(500, P)[0].signal);
    let d = g.offer(500, req(&g, "prod"));
    assert_eq!((d.projected_wait_ms, d.forecast_wait_ms), (500, 0));
}

#[test]
fn placement_prefers_the_endpoint_that_has_been_faster() {
    let mut g = Gate::new(with_endpoints(vec![ep("slow", 1), ep("fast", 1)])).unwrap();
    g.offer(0, req(&g, "prod"));
    g.offer(0, req(&g, "prod"));
    assert_eq!(
        dispatched(&drain(&mut g, 0)),
        vec![(JobId(1), 0), (JobId(2), 1)]
    );
    // Both estimated at 1000: slow took 2000 (speed 1 + 0.1 x (2 - 1) = 1.1), fast took 500
    // (1 + 0.1 x (0.5 - 1) = 0.95).
    g.on_complete(500, JobId(2), ok()).unwrap();
    g.on_complete(2000, JobId(1), ok()).unwrap();
    drain(&mut g, 2000);
    g.offer(2000, req(&g, "prod"));
    assert_eq!(dispatched(&drain(&mut g, 2000)), vec![(JobId(3), 1)]);
}

#[test]
fn a_reload_keeps_endpoint_state_by_name_and_retires_removed_ones() {
    let mut g = Gate::new(with_endpoints(vec![ep("a", 1), ep("b", 1)])).unwrap();
    g.offer(0, req(&g, "prod"));
    g.offer(0, req(&g, "prod"));
    assert_eq!(dispatched(&drain(&mut g, 0)).len(), 2);
    g.set_endpoint_ejected(0, P, 0, true);
    // New config: a with 3 slots (still ejected: health is runtime state), b gone, c new.
    g.reconfigure(10, with_endpoints(vec![ep("a", 3), ep("c", 2)]))
        .unwrap();
    let v = g.endpoints(10, P);
    assert_eq!(
        v.len(),
        3,
        "b is kept (retired) while its job runs: ids are positions"
    );
    assert!(v[0].ejected && v[0].slots == 3);
    assert_eq!(g.endpoint_id(P, "b"), None);
    assert_eq!(g.endpoint_id(P, "c"), Some(2));
    // Capacity: c's 2 (a ejected, b retired).
    assert_eq!(g.snapshot(10).pools[0].slots, 2);
    // b's job ends normally.
    assert!(g.on_complete(500, JobId(2), ok()).is_some());
    assert_eq!(g.endpoints(500, P)[1].in_flight, 0);
    // New work goes to c.
    g.offer(500, req(&g, "prod"));
    assert_eq!(dispatched(&drain(&mut g, 500)), vec![(JobId(3), 2)]);
}

#[test]
fn a_job_that_could_not_connect_moves_to_another_endpoint_that_can_start_it() {
    let mut g = Gate::new(with_endpoints(vec![ep("a", 1), ep("b", 1)])).unwrap();
    g.offer(0, req(&g, "prod"));
    assert_eq!(dispatched(&drain(&mut g, 0)), vec![(JobId(1), 0)]);
    // a refused the connection: the job moves to b, a's slot is free again.
    assert_eq!(g.reroute(5, JobId(1)), Some(1));
    let v = g.endpoints(5, P);
    assert_eq!((v[0].in_flight, v[1].in_flight), (0, 1));
    // b refuses too; a is the only other and it can start it: back to a.
    assert_eq!(g.reroute(6, JobId(1)), Some(0));
    // With a second job on b, nothing else can start the first: it stays where it was.
    g.offer(6, req(&g, "prod"));
    assert_eq!(dispatched(&drain(&mut g, 6)), vec![(JobId(2), 1)]);
    assert_eq!(g.reroute(7, JobId(1)), None);
    let v = g.endpoints(7, P);
    assert_eq!((v[0].in_flight, v[1].in_flight), (1, 1));
    // Its completion frees the endpoint it ended on.
    g.on_complete(100, JobId(1), ok()).unwrap();
    assert_eq!(g.endpoints(100, P)[0].in_flight, 0);
    assert_eq!(
        g.reroute(100, JobId(99)),
        None,
        "an unknown job is not moved"
    );
}

#[test]
fn a_job_no_endpoint_can_take_goes_back_to_the_queue_in_its_place() {
    let mut g = Gate::new(with_endpoints(vec![ep("a", 1), ep("b", 1)])).unwrap();
    g.offer(0, req(&g, "prod"));
    g.offer(0, req(&g, "prod"));
    g.offer(0, req(&g, "prod"));
    assert_eq!(dispatched(&drain(&mut g, 0)).len(), 2);
    // Job 1 could not connect to a, and b is busy: it is queued again, ahead of job 3 (its
    // deadline is no later), and a's slot goes to it at once.
    assert_eq!(g.reroute(10, JobId(1)), None);
    assert!(g.requeue(10, JobId(1)));
    assert_eq!(g.snapshot(10).pools[0].depth, 2);
    assert_eq!(dispatched(&drain(&mut g, 10)), vec![(JobId(1), 0)]);
    assert!(!g.requeue(10, JobId(3)), "a queued job is not requeued");
    assert!(!g.requeue(10, JobId(77)));
    // It ends once, freeing one slot.
    g.on_complete(1000, JobId(1), ok()).unwrap();
    assert!(g.on_complete(1000, JobId(1), ok()).is_none());
    assert_eq!(dispatched(&drain(&mut g, 1000)), vec![(JobId(3), 0)]);
    // With b ejected there is nowhere else: job 3 is not queued again (it would only go
    // back to a), and stays in flight there.
    g.set_endpoint_ejected(1000, P, 1, true);
    assert!(!g.requeue(1000, JobId(3)));
    assert_eq!(g.endpoints(1000, P)[0].in_flight, 1);
}

#[test]
fn neighbours_that_keep_coming_inflate_every_wait() {
    let mut g = Gate::new(with_endpoints(vec![ep("llama", 4)])).unwrap();
    // A neighbour holds 2 of the 4 slots, read every second from 0 to 10 s. Each reading
    // records what the previous one said for the time since it: 2 slots x 1000 ms, ten
    // times from the one at 1000 on. At 11 s the window has seen 20000 slot-ms over the
    // 10000 ms since that first record: 20000 / (4 x 10000) = a share of 0.5.
    for t in (0..=10_000).step_by(1000) {
        g.set_server_reading(t, P, 0, Some((2, 0)), 5000);
    }
    for _ in 0..2 {
        g.offer(11_000, req(&g, "prod"));
    }
    assert_eq!(dispatched(&drain(&mut g, 11_000)).len(), 2);
    // The base wait: four slots at 1000 ms (2 jobs, 2 neighbours): 1000. Neighbours taking
    // half of the server while it waits double it: 1000 / (1 - 0.5) = 2000, of which 1000
    // is the forecast. The top priority gets it too: nothing of the gate overtakes it, the
    // neighbours do.
    let d = g.offer(11_000, req(&g, "prod"));
    assert_eq!((d.projected_wait_ms, d.forecast_wait_ms), (2000, 1000));
}

#[test]
fn where_servers_report_neighbours_a_promise_is_padded_by_how_late_jobs_recently_started() {
    // The margin is the 99th percentile of the recent errors: 19 on time and one that
    // started half its promise late put it at 0.5.
    let mut g = Gate::new(with_endpoints(vec![ep("llama", 1)])).unwrap();
    let window = 300_000;
    for _ in 0..19 {
        g.classes[0].record_wait_error(0, 0.0, window);
    }
    assert_eq!(g.classes[0].wait_margin, 0.0, "19 on time: no margin");
    g.classes[0].record_wait_error(0, 0.5, window);
    assert_eq!(g.classes[0].wait_margin, 0.5);
    // Without a server signal the margin is not used: one job runs (1000 ms), the next
    // waits 1000 and fits its 4000 ms deadline (1000 + 1000 <= 4000)...
    g.offer(0, req(&g, "prod"));
    drain(&mut g, 0);
    assert_eq!(g.offer(0, req(&g, "prod")).action, Action::Admit);
    // ... and with one (the server reported, twice) the promise (a wait of 1999 behind the
    // two, + 1000 of service) is padded by half: 1999 + 0.5 x 2999 = 3498 > the 2999 of
    // slack.
    g.set_server_reading(0, P, 0, Some((1, 0)), 60_000);
    g.set_server_reading(1, P, 0, Some((1, 0)), 60_000);
    let d = g.offer(1, req(&g, "prod"));
    assert_eq!(d.projected_wait_ms, 1999);
    assert_eq!(
        (d.action, d.reason),
        (Action::Reject, Reason::ProjectedWaitExceedsSlack)
    );
    // Drops count as missing the whole promise, but the margin never passes half of it...
    for _ in 0..64 {
        g.classes[0].record_wait_error(1, 1.0, window);
    }
    assert_eq!(g.classes[0].wait_margin, 0.5);
    // ... and with no sample for a window (refused requests teach nothing) it lapses: the
    // class is not kept refused on a margin from a burst long gone.
    assert_eq!(g.classes[0].wait_margin_at(1 + window, window), 0.5);
    assert_eq!(g.classes[0].wait_margin_at(2 + window, window), 0.0);
    // Old samples are forgotten when a new one comes.
    g.classes[0].record_wait_error(2 + window, 0.0, window);
    assert_eq!(g.classes[0].wait_errors.len(), 1);
}

#[test]
fn a_capacity_share_splits_every_pool_and_gives_it_back_whole() {
    // a has 4 slots, b 2: three replicas that cannot coordinate each take a third.
    let mut g = Gate::new(with_endpoints(vec![ep("a", 4), ep("b", 2)])).unwrap();
    g.set_capacity_share(3);
    assert_eq!(g.capacity_share(), 3);
    // 4/3 = 1 on a, 2/3 = 0 on b.
    assert_eq!(g.snapshot(0).pools[0].slots, 1);
    let mut started = 0;
    for _ in 0..4 {
        let d = g.offer(0, req(&g, "prod"));
        if d.action == Action::Admit {
            started += dispatched(&drain(&mut g, 0)).len();
        }
    }
    // Only a's one slot starts work: b's share rounds to nothing, and the pool keeps a's.
    assert_eq!(started, 1);
    g.set_capacity_share(1);
    assert_eq!(g.snapshot(0).pools[0].slots, 6);
}

#[test]
fn a_share_that_rounds_to_nothing_keeps_one_slot_and_a_429_stays_within_the_share() {
    let mut g = Gate::new(with_endpoints(vec![ep("a", 2)])).unwrap();
    g.set_capacity_share(3); // 2/3 = 0: one slot kept
    assert_eq!(g.snapshot(0).pools[0].slots, 1);
    // A reload under the share keeps the share.
    let mut c = with_endpoints(vec![ep("a", 9)]);
    c.pools[0].name = g.config().pools[0].name.clone();
    g.reconfigure(0, c).unwrap();
    assert_eq!(g.snapshot(0).pools[0].slots, 3);
    let (_, _) = g.throttled(0, P, 0, Some(10));
    assert_eq!(g.endpoints(0, P)[0].limit, 1);
    g.set_capacity_share(1);
    // The throttled limit stays lowered when the share grows back.
    assert_eq!(g.endpoints(0, P)[0].limit, 1);
}

#[test]
fn a_requeued_job_is_never_taken_off_its_tenants_bucket_twice() {
    let mut c = with_endpoints(vec![ep("a", 1), ep("b", 1)]);
    c.fairness.weights.insert("t".into(), 1.0);
    let mut g = Gate::new(c).unwrap();
    let offer = |g: &mut Gate| {
        let mut r = req(g, "prod");
        r.fairness_id = Some("t".into());
        g.offer(0, r)
    };
    for _ in 0..3 {
        assert!(offer(&mut g).admitted());
    }
    assert_eq!(dispatched(&drain(&mut g, 0)).len(), 2);
    let queued = |g: &Gate| g.snapshot(10).classes[0].tenants[0].queued;
    assert_eq!(queued(&g), 1, "job 3");
    // Job 1 goes back to the queue and is dispatched again: job 3 is still counted.
    assert_eq!(g.reroute(10, JobId(1)), None);
    assert!(g.requeue(10, JobId(1)));
    assert_eq!(dispatched(&drain(&mut g, 10)), vec![(JobId(1), 0)]);
    assert_eq!(queued(&g), 1, "job 3 still queued and counted once");
}

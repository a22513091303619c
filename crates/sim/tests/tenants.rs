//! Fair share between tenants inside a class (issue 27), in the simulator: a tenant at 5x its
//! share beside two at 0.3x, with and without `[fairness]`, and with the flooding tenant
//! removed (same seed: each tenant's requests come from its own stream).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use slackgate_sim::report::PolicyReport;
use slackgate_sim::scenario::Scenario;
use slackgate_sim::tenants::TenantRow;
use std::path::PathBuf;

fn load(file: &str) -> Scenario {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scenarios");
    Scenario::load(&dir.join(file)).unwrap_or_else(|e| panic!("{e}"))
}

fn run(s: &Scenario, policy: &str) -> PolicyReport {
    let (rep, _) = slackgate_sim::simulate_with(s, &[policy.to_string()], false).unwrap();
    rep.policies.into_iter().next().unwrap()
}

fn row<'a>(p: &'a PolicyReport, tenant: &str, class: &str) -> &'a TenantRow {
    p.tenants
        .iter()
        .find(|t| t.tenant == tenant && t.class == class)
        .unwrap_or_else(|| panic!("no row for {tenant} in {class}"))
}

fn served(p: &PolicyReport) -> f64 {
    p.tenants.iter().map(|t| t.served_s).sum()
}

/// B and C on time at least 0.99 of what they get with A gone, A refused on its share, the
/// pool as busy as without fairness (0.95), and every admitted request of B and C kept.
fn check(file: &str, class: &str) {
    let s = load(file);
    let fair = run(&s, "slackgate");
    let unfair = run(&s, "slackgate-unfair");
    let mut alone = s.clone();
    alone
        .tenants
        .retain(|t| !(t.name == "A" && t.class == class));
    let without_a = run(&alone, "slackgate");
    for t in ["B", "C"] {
        let with = row(&fair, t, class);
        let base = row(&without_a, t, class);
        assert_eq!(
            with.requests, base.requests,
            "{t}: same requests either way"
        );
        assert!(
            with.on_time as f64 >= 0.99 * base.on_time as f64,
            "{file}: {t} on time {} with A flooding, {} without A",
            with.on_time,
            base.on_time
        );
        assert!(
            with.on_time > row(&unfair, t, class).on_time,
            "{file}: fairness serves {t} more than one shared line does"
        );
        assert_eq!(with.refused_share, 0, "{t} stays within its share");
    }
    let a = row(&fair, "A", class);
    assert!(a.refused_share > 0, "A is refused on its share");
    assert!(
        served(&fair) >= 0.95 * served(&unfair),
        "{file}: served {:.1} server-s with fairness, {:.1} without",
        served(&fair),
        served(&unfair)
    );
    if class == "interactive" {
        // Only A is ever refused with fairness: no two backlogged tenants to compare.
        assert_eq!(fair.tenant_fairness_gap_s, None);
    }
}

#[test]
fn a_flooding_tenant_cannot_spend_the_others_slack_in_one_class() {
    check("tenants-flood.toml", "interactive");
}

#[test]
fn a_flooding_tenant_cannot_spend_the_others_slack_beside_a_higher_class() {
    check("tenants-flood-two-class.toml", "batch");
}

/// Two tenants flooding at once, A of weight 2 and D of weight 1: the pool is split between
/// them by weight (A's served time about twice D's), the light tenant B is served more than
/// in one shared line, and the fairness figure is smaller than without fairness.
#[test]
fn two_flooding_tenants_split_the_pool_by_weight() {
    let s = load("tenants-weighted.toml");
    let fair = run(&s, "slackgate");
    let unfair = run(&s, "slackgate-unfair");
    let (a, d) = (
        row(&fair, "A", "interactive"),
        row(&fair, "D", "interactive"),
    );
    let ratio = a.served_s / d.served_s;
    assert!(
        (1.8..=2.2).contains(&ratio),
        "A/D served {ratio:.2}: {a:?} {d:?}"
    );
    assert!(a.refused_share > 0 && d.refused_share > 0);
    assert!(
        row(&fair, "B", "interactive").on_time > row(&unfair, "B", "interactive").on_time,
        "B: {:?} against {:?}",
        row(&fair, "B", "interactive"),
        row(&unfair, "B", "interactive")
    );
    let (g, u) = (
        fair.tenant_fairness_gap_s.unwrap(),
        unfair.tenant_fairness_gap_s.unwrap(),
    );
    assert!(g < u, "fairness gap {g:.1} with fairness, {u:.1} without");
}

/// A flood of long requests on 16 slots (`tenants-long-flood.toml`): a server does not
/// preempt, so without the tenant headroom B's and C's short requests wait for one of A's
/// to end; with it (the default `headroom_max_idle`) they start at once, no tenant's
/// admitted request is late, B and C are served as much, and A keeps most of what it got.
#[test]
fn the_tenant_headroom_keeps_slots_for_the_light_tenants_when_one_floods_long_requests() {
    let s = load("tenants-long-flood.toml");
    let held = run(&s, "slackgate");
    let plain = run(&s, "slackgate-work-conserving");
    for t in ["A", "B", "C"] {
        assert_eq!(
            row(&held, t, "interactive").admitted_on_time_share,
            1.0,
            "{t}"
        );
    }
    for t in ["B", "C"] {
        let (h, p) = (row(&held, t, "interactive"), row(&plain, t, "interactive"));
        assert_eq!(h.on_time, p.on_time, "{t}: as much served");
        assert!(p.ttft_p50_s >= 0.5, "{t} waits for a slot without: {p:?}");
        assert!(h.ttft_p50_s <= 0.1, "{t} starts at once with: {h:?}");
    }
    let (a, a_plain) = (
        row(&held, "A", "interactive"),
        row(&plain, "A", "interactive"),
    );
    assert!(
        a.served_s >= 0.85 * a_plain.served_s,
        "A served {:.0} s with the headroom, {:.0} s without",
        a.served_s,
        a_plain.served_s
    );
}

/// Two tenants flooding at once with the headroom at its fullest (every slot the light
/// tenant's forecast asks for), at noise 0 and 0.3: held jobs race for the same freed slots,
/// and every admitted request of every tenant is still on time.
#[test]
fn held_jobs_of_two_flooding_tenants_keep_their_promises() {
    let mut s = load("tenants-weighted.toml");
    s.slackgate.tenant_headroom_max_idle = Some(1.0);
    for noise in [0.0, 0.3] {
        s.estimator_noise = noise;
        let p = run(&s, "slackgate");
        for t in &p.tenants {
            assert_eq!(t.admitted_on_time_share, 1.0, "noise {noise}: {t:?}");
        }
        assert_eq!(p.total.dropped, 0, "noise {noise}");
    }
}

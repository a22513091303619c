//! The metrics page as scrapers see it, against `golden/metrics_page.txt`.
//!
//! One fixed state (a core gate's snapshot with every kind of row filled in, counters fed
//! through decision-log lines, the ledger and its store, the controls, both listeners, a
//! cluster replica) is rendered the way `GET /metrics` renders it, and compared family by
//! family with the golden page: every `# HELP` and `# TYPE` line exactly, every series (name
//! and labels) exactly, every value as a number (`2` and `2.0` are the same sample to a
//! scraper), and the order of families and of the series in a family left free (neither means
//! anything in the exposition format). The golden page was written by the hand-written
//! renderer this crate had before `prometheus-client`; it is what dashboards and alerts were
//! built against. Since then four `reason` label values in it were renamed by hand, when the
//! decision log's codes became types and the fixture's made-up reasons (`admitted`,
//! `dispatched`, `client_gone`, `queue_age`) became real ones (`within_slack`, `slot_free`,
//! `client_cancelled`, `queue_age_exceeded`); nothing else in it changed.
//!
//! `SLACKGATE_BLESS=1 cargo test -p slackgate-gateway --test metrics_page` rewrites the golden
//! page from the current renderer: only for a deliberate change of what scrapers see.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod metrics_fixture;

use metrics_fixture::{fixture, page};
use std::collections::BTreeMap;

const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/metrics_page.txt");

/// One family as a scraper reads it: its HELP and TYPE lines, and its samples by series.
#[derive(Debug, Default, PartialEq)]
struct Family {
    comments: Vec<String>,
    samples: BTreeMap<String, f64>,
}

/// The families of a page, by name; panics on a sample outside a family or a series twice.
fn families(text: &str) -> BTreeMap<String, Family> {
    let mut out: BTreeMap<String, Family> = BTreeMap::new();
    let mut current = String::new();
    for l in text.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = l.strip_prefix("# ") {
            let name = rest.split(' ').nth(1).unwrap_or_default();
            current = name.to_string();
            out.entry(current.clone())
                .or_default()
                .comments
                .push(l.to_string());
            continue;
        }
        let (series, value) = l.rsplit_once(' ').unwrap();
        let value: f64 = value.parse().unwrap();
        let fam = out.get_mut(&current).unwrap();
        assert!(
            fam.samples.insert(series.to_string(), value).is_none(),
            "{series} twice"
        );
    }
    out
}

#[test]
fn the_page_is_what_scrapers_saw_before() {
    let f = fixture(0);
    let text = page(&f, f.snap.clone());
    if std::env::var_os("SLACKGATE_BLESS").is_some() {
        std::fs::write(GOLDEN, &text).unwrap();
    }
    let golden = std::fs::read_to_string(GOLDEN).unwrap();
    let (want, got) = (families(&golden), families(&text));
    let names = |m: &BTreeMap<String, Family>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(names(&want), names(&got), "the families differ");
    for (name, w) in &want {
        assert_eq!(Some(w), got.get(name), "family {name}");
    }
}

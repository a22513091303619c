//! Fair share between tenants in front of a real llama-server (issue 27): three tenants of
//! equal weight send the interactive chat of `scenarios/llama-tenants.toml`, A at 5x its share
//! and B and C at 0.3x (1.87x what the server gets through, measured just before the run). The
//! gate runs `deploy/examples/llama-server.toml` (default priors: it must learn the server)
//! with `[fairness] weights` for A, B and C; the drill's clients name their tenant in
//! `x-llm-d-inference-fairness-id`. B and C are served on time (95% of what they send), and
//! A is refused early on its share (`tenant_share_exceeded`), its admitted requests on time.
//! `scripts/test.sh` starts the server and sets `SLACKGATE_LLAMA_URL`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use slackgate_drill::{DrillOptions, Mode, RealUpstream, Target};
use slackgate_gateway::config::Config;
use slackgate_sim::scenario::Scenario;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a llama-server: scripts/test.sh starts one and sets SLACKGATE_LLAMA_URL"]
async fn a_flooding_tenant_is_refused_on_its_share_in_front_of_a_real_llama_server() {
    let url = std::env::var("SLACKGATE_LLAMA_URL")
        .expect("needs a llama-server: scripts/test.sh starts one and sets SLACKGATE_LLAMA_URL");
    let s = Scenario::load(&repo().join("scenarios/llama-tenants.toml")).unwrap();
    let mut cfg = Config::from_file(&repo().join("deploy/examples/llama-server.toml")).unwrap();
    for t in &s.tenants {
        cfg.gate.fairness.weights.insert(t.name.clone(), t.weight);
    }
    let opts = DrillOptions {
        target: Target::Real(RealUpstream {
            url,
            model: None,
            chars_per_token: None,
            config: Some(Box::new(cfg)),
        }),
        modes: vec![Mode::On],
        error_after_s: 20.0,
        // 5 + 0.3 + 0.3 shares of a third each: 1.87x what the server gets through.
        load: Some(1.87),
        ..DrillOptions::default()
    };
    let d = tokio::time::timeout(Duration::from_secs(600), slackgate_drill::run(&s, &opts))
        .await
        .expect("the drill ran over 10 minutes")
        .expect("the drill ran");
    let md = d.to_markdown();
    println!("{md}");
    assert!(d.healthy(), "{md}");
    let on = &d.report.policies[0];
    assert_eq!(on.tenants.len(), 3, "{md}");
    for t in &on.tenants {
        if t.tenant == "A" {
            assert!(t.refused_share > 0, "A refused on its share: {t:?}\n{md}");
            assert!(
                t.admitted_on_time_share >= 0.97,
                "A's admitted requests on time: {t:?}\n{md}"
            );
        } else {
            assert!(
                t.on_time as f64 >= 0.95 * t.requests as f64,
                "{} on time {} of {}\n{md}",
                t.tenant,
                t.on_time,
                t.requests
            );
        }
    }
}

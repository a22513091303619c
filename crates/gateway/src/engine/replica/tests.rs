#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::*;
use http::HeaderValue;

fn cfg() -> ClusterConfig {
    ClusterConfig {
        redis: "redis://127.0.0.1:6379".into(),
        replica_id: Some("me".into()),
        ..ClusterConfig::default()
    }
}

fn listen() -> std::net::SocketAddr {
    "127.0.0.1:8080".parse().unwrap()
}

fn cluster() -> Cluster {
    Cluster::new(&cfg(), listen()).unwrap()
}

#[test]
fn the_section_refuses_what_cannot_work_and_names_the_field() {
    let l = listen();
    let cases: Vec<(ClusterConfig, &str)> = vec![
        (
            ClusterConfig {
                redis: String::new(),
                ..cfg()
            },
            "cluster.redis",
        ),
        (
            ClusterConfig {
                redis: "rediss://h:1".into(),
                ..cfg()
            },
            "cluster.redis",
        ),
        (
            ClusterConfig {
                redis: "http://h:1".into(),
                ..cfg()
            },
            "cluster.redis",
        ),
        (
            ClusterConfig {
                name: "a b".into(),
                ..cfg()
            },
            "cluster.name",
        ),
        (
            ClusterConfig {
                name: "x".repeat(65),
                ..cfg()
            },
            "cluster.name",
        ),
        (
            ClusterConfig {
                replica_id: Some("a|b".into()),
                ..cfg()
            },
            "cluster.replica_id",
        ),
        (
            ClusterConfig {
                lease_ttl_ms: 10,
                ..cfg()
            },
            "cluster.lease_ttl_ms",
        ),
        (
            ClusterConfig {
                redis_timeout_ms: 2_000,
                ..cfg()
            },
            "cluster.redis_timeout_ms",
        ),
        (
            ClusterConfig {
                redis_timeout_ms: 0,
                ..cfg()
            },
            "cluster.redis_timeout_ms",
        ),
        (
            ClusterConfig {
                forward_connect_timeout_ms: 0,
                ..cfg()
            },
            "cluster.forward_connect_timeout_ms",
        ),
        (
            ClusterConfig {
                advertise: Some("ftp://x".into()),
                ..cfg()
            },
            "cluster.advertise",
        ),
    ];
    for (c, field) in cases {
        let e = c.validate(l).unwrap_err().to_string();
        assert!(e.contains(field), "{field}: {e}");
    }
    // An unspecified listen address cannot be advertised.
    let any: std::net::SocketAddr = "0.0.0.0:8080".parse().unwrap();
    assert!(cfg()
        .validate(any)
        .unwrap_err()
        .to_string()
        .contains("cluster.advertise"));
    let ok = ClusterConfig {
        advertise: Some("http://10.0.0.7:8080".into()),
        ..cfg()
    };
    assert!(ok.validate(any).is_ok());
    assert_eq!(ok.advertise_url(any), "http://10.0.0.7:8080");
    assert_eq!(cfg().advertise_url(l), "http://127.0.0.1:8080");
}

#[test]
fn a_replica_decides_only_while_its_lease_holds_and_forwards_otherwise() {
    let c = cluster();
    // Before the first heartbeat has ended: wait for it (a cold start is not an outage).
    assert_eq!(c.route(false), Route::Wait);
    assert_eq!(c.route(true), Route::Wait);
    assert!(!c.readiness().ready);
    lock(&c.view).last_attempt = Some(Instant::now());
    // It ended and Redis did not answer: no leader known, no Redis: degraded, and ready
    // (requests follow their fail mode).
    assert_eq!(c.route(false), Route::Degraded);
    assert!(c.readiness().ready, "{:?}", c.readiness());
    assert_eq!(c.share_parts(), 1);
    let three = Cluster::new(
        &ClusterConfig {
            expected_replicas: 3,
            ..cfg()
        },
        listen(),
    )
    .unwrap();
    assert_eq!(three.share_parts(), 3);
    assert_eq!(c.route(true), Route::NotLeader);
    {
        let mut v = lock(&c.view);
        v.redis_up = true;
        v.last_ok = Some(Instant::now());
        v.leader = Some(Leader {
            id: "other".into(),
            url: "http://10.0.0.2:8080".into(),
            epoch: 4,
        });
        v.replicas = vec![
            Replica {
                id: "me".into(),
                url: String::new(),
                seen_ms_ago: 0,
            },
            Replica {
                id: "other".into(),
                url: String::new(),
                seen_ms_ago: 0,
            },
        ];
    }
    assert_eq!(
        c.route(false),
        Route::Forward("http://10.0.0.2:8080".into())
    );
    assert_eq!(c.share_parts(), 2);
    assert_eq!(c.status().role, Role::Follower);
    // A forward that failed: the leader is forgotten until a heartbeat names one again,
    // and not tried again for a while.
    c.suspect_leader();
    assert_eq!(c.route(false), Route::Degraded);
    assert_eq!(c.status().role, Role::Degraded);
    assert!(c.status().leader.is_none());
    {
        let mut v = lock(&c.view);
        // The next heartbeat names it again; the window still holds it off.
        v.leader = Some(Leader {
            id: "other".into(),
            url: "http://10.0.0.2:8080".into(),
            epoch: 4,
        });
    }
    assert_eq!(c.route(false), Route::Degraded);
    {
        let mut v = lock(&c.view);
        v.leader_suspect_until = None;
        // Redis last answered longer ago than a lease: the leader still gets the request
        // (it checks its own lease).
        v.last_ok = Some(Instant::now() - Duration::from_millis(c.cfg.lease_ttl_ms + 1));
        v.redis_up = false;
    }
    assert_eq!(
        c.route(false),
        Route::Forward("http://10.0.0.2:8080".into())
    );
    {
        let mut v = lock(&c.view);
        v.last_ok = Some(Instant::now());
        v.leader = Some(Leader {
            id: "me".into(),
            url: c.advertise.clone(),
            epoch: 5,
        });
        v.lead_until = Some(Instant::now() + Duration::from_secs(5));
    }
    assert_eq!(c.route(false), Route::Local);
    assert_eq!(c.route(true), Route::Local);
    assert_eq!(c.share_parts(), 1);
    assert_eq!(c.local_mode(), Role::Leader);
    // The lease lapsed (no renewal in time): it stops deciding at once, even before the
    // lease thread notices.
    lock(&c.view).lead_until = Some(Instant::now() - Duration::from_millis(1));
    assert_eq!(c.route(false), Route::Degraded);
    assert_eq!(c.route(true), Route::NotLeader);
    assert_eq!(c.local_mode(), Role::Degraded);
}

#[test]
fn only_the_clusters_secret_marks_a_forwarded_request() {
    let c = cluster();
    let mut h = HeaderMap::new();
    h.insert(FORWARDED_HEADER, HeaderValue::from_static("guess"));
    // No secret known yet: nothing is trusted.
    assert!(!c.is_forwarded(&h));
    lock(&c.view).secret = Some("s3cret".into());
    assert!(!c.is_forwarded(&h));
    h.insert(FORWARDED_HEADER, HeaderValue::from_static("s3cret"));
    assert!(c.is_forwarded(&h));
    h.insert(FORWARDED_HEADER, HeaderValue::from_static("s3cret2"));
    assert!(!c.is_forwarded(&h));
    strip_cluster_headers(&mut h);
    assert!(h.get(FORWARDED_HEADER).is_none());
}

#[test]
fn metrics_name_the_replica_and_every_event() {
    let out = metrics_page(&cluster());
    assert!(out.contains("slackgate_cluster_leader{replica=\"me\"} 0"));
    assert!(out.contains("slackgate_cluster_degraded{replica=\"me\"} 1"));
    for e in [
        "forwarded",
        "forward_failed",
        "fail_open",
        "fail_closed",
        "leader_acquired",
        "leader_lost",
        "redis_error",
    ] {
        assert!(out.contains(&format!("event=\"{e}\"")), "{e}");
    }
}

/// The cluster's families alone, as the metrics page writes them.
fn metrics_page(c: &Cluster) -> String {
    let registry = prometheus_client::registry::Registry::default();
    let mut page = crate::observe::exposition::Page::new(&registry);
    page.collect(c.metrics());
    page.render()
}

#[test]
fn the_replica_label_is_escaped() {
    // Today's ids cannot hold these characters (cluster.replica_id is checked, the host's name
    // is filtered), but the page must not depend on that: the label is escaped like any other.
    let mut c = cluster();
    c.replica_id = "a\"b\\c\nd".into();
    let out = metrics_page(&c);
    assert!(
        out.contains("slackgate_cluster_leader{replica=\"a\\\"b\\\\c\\nd\"} 0\n"),
        "{out}"
    );
    assert!(out.contains(
        "slackgate_cluster_events_total{replica=\"a\\\"b\\\\c\\nd\",event=\"forwarded\"} 0\n"
    ));
    // Every line is a comment or one sample: the id's newline did not start a line.
    assert!(out
        .lines()
        .all(|l| l.starts_with("# ") || l.starts_with("slackgate_cluster_")));
}

#[test]
fn a_replica_waiting_out_the_lease_it_took_holds_requests_and_is_not_ready() {
    let c = cluster();
    {
        let mut v = lock(&c.view);
        v.redis_up = true;
        v.last_attempt = Some(Instant::now());
        v.leader = Some(Leader {
            id: "me".into(),
            url: c.advertise.clone(),
            epoch: 1,
        });
        v.standby_until = Some(Instant::now() + Duration::from_millis(500));
    }
    // Its own requests and those forwarded to it wait; it is not ready.
    assert_eq!(c.route(false), Route::Wait);
    assert_eq!(c.route(true), Route::Wait);
    let r = c.readiness();
    assert!(!r.ready && r.why.contains("waiting out"), "{r:?}");
    // Redis goes away meanwhile: the fail mode decides, and it is ready on it.
    lock(&c.view).redis_up = false;
    assert_eq!(c.route(false), Route::Degraded);
    assert!(c.readiness().ready);
    // It leads: local, ready as leader.
    {
        let mut v = lock(&c.view);
        v.redis_up = true;
        v.standby_until = None;
        v.lead_until = Some(Instant::now() + Duration::from_secs(1));
    }
    assert_eq!(c.route(false), Route::Local);
    assert_eq!(c.readiness().why, "leader");
    // Another replica holds the lease and is named: a follower, ready.
    {
        let mut v = lock(&c.view);
        v.lead_until = None;
        v.leader = Some(Leader {
            id: "other".into(),
            url: "http://10.0.0.2:8080".into(),
            epoch: 2,
        });
    }
    assert_eq!(c.readiness().why, "follower");
}

#[tokio::test(start_paused = true)]
async fn a_request_waits_for_the_leader_at_most_its_bound() {
    let c = cluster();
    let t0 = tokio::time::Instant::now();
    // No heartbeat ever ends: the wait gives up at the bound, still `Wait`.
    let r = c
        .route_when_settled(false, Duration::from_millis(300))
        .await;
    assert_eq!(r, Route::Wait);
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_millis(320),
        "{waited:?}"
    );
    assert_eq!(
        c.settle_bound(),
        Duration::from_millis(c.cfg.lease_ttl_ms * 2 + c.cfg.redis_timeout_ms)
    );
}

//! The admin API's route table: [`Route::of`] matches a method and a path to one route (the
//! table in [the module's doc](super)), and [`answer`] hands it to that route's handler. A
//! path the table knows, asked with a method it does not take there, is 405; any other path
//! is 404.

use super::{flag_value, invalid, json_body, truncate, Refused};
use crate::engine::state::Shared;
use crate::ops::control;
use crate::wire::response::{self, ResBody};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::json;

/// The flags `PUT /admin/flags/{flag}` sets.
const FLAGS: [&str; 2] = ["admit_always", "shadow"];
/// Most classes one drain request may name.
const MAX_DRAIN_CLASSES: usize = 256;
/// Longest class name a drain request may name.
const MAX_CLASS_NAME: usize = 256;

/// One admin route: a method on a path, with what the path names.
#[derive(Debug, PartialEq)]
pub(super) enum Route<'p> {
    /// `GET /admin/flags`.
    Flags,
    /// `PUT/POST /admin/flags/{flag}`.
    SetFlag(&'p str),
    /// `PUT/POST /admin/classes/{class}/enabled`.
    SetClassEnabled(&'p str),
    /// `GET /admin/drain`.
    DrainStatus,
    /// `POST /admin/drain`.
    StartDrain,
    /// `DELETE /admin/drain`.
    EndDrain,
    /// `POST /admin/pools/{pool}/endpoints/{endpoint}/drain` (or `/undrain`).
    DrainEndpoint {
        pool: &'p str,
        endpoint: &'p str,
        draining: bool,
    },
    /// `GET /admin/queues`.
    Queues,
    /// `GET /admin/estimator`.
    Estimator,
    /// `GET /admin/ledger`.
    Ledger,
    /// `GET /admin/cluster`.
    Cluster,
    /// `POST /admin/reload`.
    Reload,
}

/// Why a request has no route.
#[derive(Debug, PartialEq)]
pub(super) enum NoRoute {
    /// The table knows the path, not under this method (405).
    MethodNotAllowed,
    /// The table does not know the path (404).
    NotFound,
}

impl<'p> Route<'p> {
    /// The route of `method` on a path split into its segments (`["admin", "flags"]`).
    pub(super) fn of(method: &Method, parts: &[&'p str]) -> Result<Route<'p>, NoRoute> {
        let get = method == Method::GET;
        let post = method == Method::POST;
        let write = post || method == Method::PUT;
        let found = match *parts {
            ["admin", "flags"] => get.then_some(Route::Flags),
            ["admin", "flags", flag] => write.then_some(Route::SetFlag(flag)),
            ["admin", "classes", class, "enabled"] => {
                write.then_some(Route::SetClassEnabled(class))
            }
            ["admin", "drain"] if get => Some(Route::DrainStatus),
            ["admin", "drain"] if post => Some(Route::StartDrain),
            ["admin", "drain"] => (method == Method::DELETE).then_some(Route::EndDrain),
            ["admin", "pools", pool, "endpoints", endpoint, action @ ("drain" | "undrain")] => post
                .then_some(Route::DrainEndpoint {
                    pool,
                    endpoint,
                    draining: action == "drain",
                }),
            ["admin", "queues"] => get.then_some(Route::Queues),
            ["admin", "estimator"] => get.then_some(Route::Estimator),
            ["admin", "ledger"] => get.then_some(Route::Ledger),
            ["admin", "cluster"] => get.then_some(Route::Cluster),
            ["admin", "reload"] => post.then_some(Route::Reload),
            _ => return Err(NoRoute::NotFound),
        };
        found.ok_or(NoRoute::MethodNotAllowed)
    }
}

impl NoRoute {
    /// The 405 or 404 to answer `method` on `path`.
    pub(super) fn refused(&self, method: &Method, path: &str) -> Refused {
        match self {
            NoRoute::MethodNotAllowed => Refused::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                format!("{method} is not allowed on {}", truncate(path)),
            ),
            NoRoute::NotFound => Refused::new(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("no admin route for {}", truncate(path)),
            ),
        }
    }
}

/// Answer a request with its route's handler; `Err` is the 4xx to answer. `who` is the actor
/// named in the decision-log line of a change.
pub(super) async fn answer(
    shared: &Shared,
    route: Route<'_>,
    req: Request<Incoming>,
    who: &str,
) -> Result<Response<ResBody>, Refused> {
    match route {
        Route::Flags => Ok(response::json(&control::flags(shared))),
        Route::SetFlag(flag) => set_flag(shared, flag, req, who).await,
        Route::SetClassEnabled(class) => set_class_enabled(shared, class, req, who).await,
        Route::DrainStatus => Ok(response::json(&control::drain_status(shared))),
        Route::StartDrain => start_drain(shared, req, who).await,
        Route::EndDrain => end_drain(shared, req, who).await,
        Route::DrainEndpoint {
            pool,
            endpoint,
            draining,
        } => drain_endpoint(shared, pool, endpoint, draining, who),
        Route::Queues => Ok(response::json(&queues(shared))),
        Route::Estimator => Ok(response::json(&estimator(shared))),
        Route::Ledger => Ok(ledger(shared)),
        Route::Cluster => cluster(shared),
        Route::Reload => Ok(response::json(&control::reload_from_source(shared, who)?)),
    }
}

/// `PUT/POST /admin/flags/{flag}`: set `admit_always` or `shadow` (`null`: back to the file).
async fn set_flag(
    shared: &Shared,
    flag: &str,
    req: Request<Incoming>,
    who: &str,
) -> Result<Response<ResBody>, Refused> {
    if !FLAGS.contains(&flag) {
        return Err(Refused::new(
            StatusCode::NOT_FOUND,
            "unknown_flag",
            format!(
                "unknown flag {:?} (flags: admit_always, shadow; per class: /admin/classes/<class>/enabled; drains: /admin/drain)",
                truncate(flag)
            ),
        ));
    }
    let value = flag_value(&json_body(req).await?)?;
    let view = if flag == "admit_always" {
        control::set_admit_always(shared, value, who)
    } else {
        control::set_shadow(shared, value, who)
    };
    Ok(response::json(
        &json!({"flag": flag, "value": view.value, "override": view.override_value, "config": view.config}),
    ))
}

/// `PUT/POST /admin/classes/{class}/enabled`: enable or disable one class (`null`: back to
/// the file).
async fn set_class_enabled(
    shared: &Shared,
    class: &str,
    req: Request<Incoming>,
    who: &str,
) -> Result<Response<ResBody>, Refused> {
    let value = flag_value(&json_body(req).await?)?;
    let view = control::set_class_enabled(shared, class, value, who)?;
    Ok(response::json(
        &json!({"class": class, "flag": "enabled", "value": view.value, "override": view.override_value, "config": view.config}),
    ))
}

/// The body of `POST /admin/drain`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DrainBody {
    #[serde(default)]
    classes: Vec<String>,
    #[serde(default)]
    cancel: bool,
    #[serde(default)]
    unlabeled: bool,
}

/// `DELETE /admin/drain` with a body: end the drain of these classes only.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EndDrainBody {
    #[serde(default)]
    classes: Vec<String>,
    /// Also admit unlabeled work again.
    #[serde(default)]
    unlabeled: bool,
}

/// `POST /admin/drain`: drain the classes named (and unlabeled work if asked).
async fn start_drain(
    shared: &Shared,
    req: Request<Incoming>,
    who: &str,
) -> Result<Response<ResBody>, Refused> {
    let body = json_body(req).await?;
    let d: DrainBody = serde_json::from_value(body).map_err(|e| {
        invalid(&format!(
            "expected {{\"classes\": [\"eval\"], \"cancel\": false, \"unlabeled\": false}}: {e}"
        ))
    })?;
    if d.classes.is_empty() && !d.unlabeled {
        return Err(invalid(
            "name at least one class to drain (or \"unlabeled\": true)",
        ));
    }
    check_class_names(&d.classes)?;
    let status = control::drain(shared, &d.classes, d.cancel, d.unlabeled, who)?;
    Ok(response::json(&status))
}

/// `DELETE /admin/drain`: no body ends every drain; a body names the classes whose drain ends.
async fn end_drain(
    shared: &Shared,
    req: Request<Incoming>,
    who: &str,
) -> Result<Response<ResBody>, Refused> {
    let body = json_body(req).await?;
    let ended = if body.is_null() {
        control::end_drain(shared, None, true, who)
    } else {
        let usage =
            "expected no body (end every drain) or {\"classes\": [\"eval\"], \"unlabeled\": false}";
        let d: EndDrainBody =
            serde_json::from_value(body).map_err(|e| invalid(&format!("{usage}: {e}")))?;
        if d.classes.is_empty() && !d.unlabeled {
            return Err(invalid(usage));
        }
        check_class_names(&d.classes)?;
        control::end_drain(shared, Some(&d.classes), d.unlabeled, who)
    };
    Ok(response::json(&ended?))
}

/// A drain request names at most [`MAX_DRAIN_CLASSES`] classes of at most
/// [`MAX_CLASS_NAME`] bytes each.
fn check_class_names(classes: &[String]) -> Result<(), Refused> {
    if classes.len() > MAX_DRAIN_CLASSES || classes.iter().any(|c| c.len() > MAX_CLASS_NAME) {
        return Err(invalid("too many or too long class names"));
    }
    Ok(())
}

/// `POST /admin/pools/{pool}/endpoints/{endpoint}/drain` (or `/undrain`): take one endpoint
/// out of placement, or put it back.
fn drain_endpoint(
    shared: &Shared,
    pool: &str,
    endpoint: &str,
    draining: bool,
    who: &str,
) -> Result<Response<ResBody>, Refused> {
    let changed = shared
        .drain_endpoint(pool, endpoint, draining, who)
        .map_err(|e| Refused::new(StatusCode::NOT_FOUND, "not_found", truncate(&e.to_string())))?;
    Ok(response::json(&json!({
        "pool": pool, "endpoint": endpoint, "draining": draining, "changed": changed,
    })))
}

/// `GET /admin/ledger`: the reservation ledger's totals and its store.
fn ledger(shared: &Shared) -> Response<ResBody> {
    let (ledger, _) = shared.ledger_view();
    response::json(&json!({"ledger": ledger, "store": shared.store.stats()}))
}

/// `GET /admin/cluster`: this replica's view of the cluster; 404 when it runs alone.
fn cluster(shared: &Shared) -> Result<Response<ResBody>, Refused> {
    match &shared.cluster {
        Some(c) => Ok(response::json(&c.status())),
        None => Err(Refused::new(
            StatusCode::NOT_FOUND,
            "not_clustered",
            "this gate runs alone (no [cluster] section)",
        )),
    }
}

/// `GET /admin/queues`: the live queue per class and the slots per pool.
fn queues(shared: &Shared) -> serde_json::Value {
    let snap = shared.snapshot();
    let classes: Vec<_> = snap
        .classes
        .iter()
        .map(|c| {
            json!({
                "class": c.name, "pool": c.pool, "priority": c.priority,
                "enabled": c.enabled, "draining": c.draining, "overflow": c.overflow,
                "retired": c.retired, "depth": c.depth,
                "oldest_queue_age_ms": c.oldest_queue_age_ms,
                "projected_wait_ms": c.projected_wait_ms, "queued_work_ms": c.queued_work_ms,
                "in_flight": c.in_flight,
            })
        })
        .collect();
    let pools: Vec<_> = snap
        .pools
        .iter()
        .map(|p| {
            json!({
                "pool": p.name, "slots": p.slots, "in_flight": p.in_flight, "depth": p.depth,
                "oldest_in_flight_age_ms": p.oldest_in_flight_age_ms,
                "in_flight_remaining_ms": p.in_flight_remaining_ms, "retired": p.retired,
                "headroom_slots": p.headroom_slots,
                "headroom_reserved_slots": p.headroom_reserved_slots,
                "endpoints": p.endpoints,
            })
        })
        .collect();
    json!({"now_ms": snap.now_ms, "classes": classes, "pools": pools})
}

/// `GET /admin/estimator`: what the gate believes a request costs, per pool and class.
fn estimator(shared: &Shared) -> serde_json::Value {
    let snap = shared.snapshot();
    let pools: Vec<_> = snap
        .pools
        .iter()
        .map(|p| {
            json!({
                "pool": p.name, "overhead_ms": p.estimator.overhead_ms,
                "prefill_ms_per_token": p.estimator.prefill_ms_per_token,
                "decode_ms_per_token": p.estimator.decode_ms_per_token,
                "decode_ms_per_1k_context": p.estimator.decode_ms_per_1k_context,
                "batch_slowdown": p.estimator.batch_slowdown,
                "decode_ms_per_1k_shared_context": p.estimator.decode_ms_per_1k_shared_context,
                "stall_ms_per_prefill_token": p.estimator.stall_ms_per_prefill_token,
                "chars_per_token": p.chars_per_token,
                "template_tokens": p.template_tokens,
                "mean_concurrency": p.mean_concurrency,
                "samples": p.estimator.samples, "learning": p.learning,
                "warming_up": p.warming_up,
            })
        })
        .collect();
    let classes: Vec<_> = snap
        .classes
        .iter()
        .filter(|c| !c.overflow)
        .map(|c| {
            json!({
                "class": c.name, "expected_output_tokens": c.expected_output_tokens,
                "est_error": c.est_error, "probes": c.probes,
            })
        })
        .collect();
    json!({"pools": pools, "classes": classes})
}

#[cfg(test)]
mod tests {
    use super::{NoRoute, Route};
    use http::Method;

    fn route_of(method: Method, path: &str) -> Result<Route<'_>, NoRoute> {
        let parts: Vec<&str> = path.split('/').skip(1).collect();
        Route::of(&method, &parts)
    }

    #[test]
    fn each_route_takes_its_methods() {
        assert_eq!(route_of(Method::GET, "/admin/flags"), Ok(Route::Flags));
        assert_eq!(
            route_of(Method::PUT, "/admin/flags/shadow"),
            Ok(Route::SetFlag("shadow"))
        );
        assert_eq!(
            route_of(Method::POST, "/admin/classes/eval/enabled"),
            Ok(Route::SetClassEnabled("eval"))
        );
        assert_eq!(
            route_of(Method::GET, "/admin/drain"),
            Ok(Route::DrainStatus)
        );
        assert_eq!(
            route_of(Method::POST, "/admin/drain"),
            Ok(Route::StartDrain)
        );
        assert_eq!(
            route_of(Method::DELETE, "/admin/drain"),
            Ok(Route::EndDrain)
        );
        assert_eq!(
            route_of(Method::POST, "/admin/pools/p/endpoints/e/undrain"),
            Ok(Route::DrainEndpoint {
                pool: "p",
                endpoint: "e",
                draining: false
            })
        );
        assert_eq!(route_of(Method::POST, "/admin/reload"), Ok(Route::Reload));
    }

    #[test]
    fn a_known_path_under_another_method_is_405_else_404() {
        assert_eq!(
            route_of(Method::GET, "/admin/flags/shadow"),
            Err(NoRoute::MethodNotAllowed)
        );
        assert_eq!(
            route_of(Method::PUT, "/admin/drain"),
            Err(NoRoute::MethodNotAllowed)
        );
        assert_eq!(
            route_of(Method::GET, "/admin/pools/p/endpoints/e/drain"),
            Err(NoRoute::MethodNotAllowed)
        );
        assert_eq!(
            route_of(Method::POST, "/admin/queues"),
            Err(NoRoute::MethodNotAllowed)
        );
        assert_eq!(
            route_of(Method::GET, "/admin/pools/p/endpoints/e/pause"),
            Err(NoRoute::NotFound)
        );
        assert_eq!(route_of(Method::GET, "/admin"), Err(NoRoute::NotFound));
    }
}

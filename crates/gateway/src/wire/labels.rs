//! Class labels other tools send, and the map from them to the gate's classes.
//!
//! A request names its class with `X-Job-Class`. Routers and load generators that do not know
//! the gate name it their own way: llm-d's `x-llm-d-inference-objective` (a name), a priority
//! number (vLLM's body `priority`, SGLang's router `x-smg-priority`, Dynamo's
//! `x-dynamo-request-priority`). `[server.class_map]` turns those into a class: objectives by
//! name, priorities by inclusive ranges. `X-Job-Class` always wins; then the objective; then
//! the priority. Like every client input these are parsed strictly: a malformed, conflicting
//! or out-of-range value is refused with a message naming the header, never guessed at.

use super::request_info::BadRequest;
use http::HeaderMap;
use serde::Deserialize;
use slackgate_core::Reason;
use std::collections::BTreeMap;

/// llm-d's objective header: a name, mapped through `objectives` (else used as a label).
pub const OBJECTIVE_HEADER: &str = "x-llm-d-inference-objective";
/// Priority headers, in the order they are read (SGLang's router, then Dynamo's).
pub const PRIORITY_HEADERS: [&str; 2] = ["x-smg-priority", "x-dynamo-request-priority"];
/// Longest objective name considered (as for `X-Job-Class`).
const MAX_OBJECTIVE_LEN: usize = 64;

/// `[server.class_map]`: how other tools' labels become classes.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct ClassMap {
    /// `x-llm-d-inference-objective` value -> class name (or alias). An objective not listed
    /// is used as a label itself: it selects the class or alias of that name, if any.
    pub objectives: BTreeMap<String, String>,
    /// Priority ranges -> class, for requests with neither `X-Job-Class` nor an objective.
    /// Empty (the default): priorities are not read at all.
    pub priorities: Vec<PriorityRange>,
}

/// One inclusive range of priority numbers and the class it selects.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PriorityRange {
    /// Lowest priority number in the range.
    pub min: i64,
    /// Highest priority number in the range.
    pub max: i64,
    /// The class (name or alias) these priorities get.
    pub class: String,
}

fn refuse(message: String) -> BadRequest {
    BadRequest {
        reason: Reason::InvalidRequest,
        message,
    }
}

impl ClassMap {
    /// The map's own consistency: every class named exists (`is_class`), ranges are
    /// ordered and do not overlap. The error is `(field path, message)`.
    pub fn check(&self, is_class: impl Fn(&str) -> bool) -> Result<(), (String, String)> {
        for (objective, class) in &self.objectives {
            if !is_class(class) {
                return Err((
                    format!("server.class_map.objectives.{objective}"),
                    format!("{class:?} is not a class name or alias"),
                ));
            }
        }
        for (i, r) in self.priorities.iter().enumerate() {
            let path = format!("server.class_map.priorities[{i}]");
            if !is_class(&r.class) {
                return Err((path, format!("{:?} is not a class name or alias", r.class)));
            }
            if r.min > r.max {
                return Err((path, format!("min {} is above max {}", r.min, r.max)));
            }
            if let Some(j) = self.priorities[..i]
                .iter()
                .position(|o| o.min <= r.max && r.min <= o.max)
            {
                return Err((path, format!("overlaps server.class_map.priorities[{j}]")));
            }
        }
        Ok(())
    }

    /// The class label for a request without `X-Job-Class`: from its objective, else from its
    /// priority (headers, then `body_priority`: the body's `priority` as JSON text), else none.
    pub fn label(
        &self,
        h: &HeaderMap,
        body_priority: Option<&str>,
    ) -> Result<Option<String>, BadRequest> {
        if let Some(objective) = one_value(h, OBJECTIVE_HEADER)? {
            if objective.len() > MAX_OBJECTIVE_LEN {
                return Err(refuse(format!(
                    "{OBJECTIVE_HEADER}: {} bytes, over the limit of {MAX_OBJECTIVE_LEN}",
                    objective.len()
                )));
            }
            if !objective.is_empty() {
                let mapped = self.objectives.get(objective).map(String::as_str);
                return Ok(Some(mapped.unwrap_or(objective).to_string()));
            }
        }
        if self.priorities.is_empty() {
            return Ok(None);
        }
        let Some(p) = priority(h, body_priority)? else {
            return Ok(None);
        };
        Ok(self
            .priorities
            .iter()
            .find(|r| (r.min..=r.max).contains(&p))
            .map(|r| r.class.clone()))
    }
}

/// A header's value, trimmed; several copies must agree (a proxy that appends a second value
/// must not let a client's first one win silently).
fn one_value<'a>(h: &'a HeaderMap, name: &str) -> Result<Option<&'a str>, BadRequest> {
    let mut found: Option<&str> = None;
    for v in h.get_all(name) {
        let v = v
            .to_str()
            .map(str::trim)
            .map_err(|_| refuse(format!("{name}: not visible ASCII")))?;
        match found {
            Some(f) if f != v => {
                return Err(refuse(format!(
                    "{name}: sent twice with different values ({f:?}, {v:?})"
                )))
            }
            _ => found = Some(v),
        }
    }
    Ok(found)
}

/// The priority number: every source present must parse and all must agree.
fn priority(h: &HeaderMap, body_priority: Option<&str>) -> Result<Option<i64>, BadRequest> {
    let mut found: Option<(&str, i64)> = None;
    let headers = PRIORITY_HEADERS
        .iter()
        .map(|n| one_value(h, n).map(|v| v.map(|v| (*n, v))));
    let body = std::iter::once(Ok(body_priority.map(|v| ("body priority", v))));
    for source in headers.chain(body) {
        let Some((name, text)) = source? else {
            continue;
        };
        let p = parse_priority(name, text)?;
        match found {
            Some((first, q)) if q != p => {
                return Err(refuse(format!("{name} ({p}) disagrees with {first} ({q})")))
            }
            _ => found = Some((name, p)),
        }
    }
    Ok(found.map(|(_, p)| p))
}

/// A whole number, negative allowed (vLLM: lower runs first; the ranges decide what it
/// means); `5.0` is 5, `5.5`, `"5"`, `1e30` and text are refused.
fn parse_priority(name: &str, text: &str) -> Result<i64, BadRequest> {
    if let Ok(n) = text.parse::<i64>() {
        return Ok(n);
    }
    const LIMIT: f64 = 9.0e15; // whole numbers an f64 holds exactly
    match text.parse::<f64>() {
        Ok(f) if f.is_finite() && f.fract() == 0.0 && f.abs() <= LIMIT => Ok(f as i64),
        _ => Err(refuse(format!(
            "{name}: {:?} is not a whole number (at most 9e15 either way)",
            text.chars().take(40).collect::<String>(),
        ))),
    }
}

#[cfg(test)]
#[path = "labels_tests.rs"]
mod tests;

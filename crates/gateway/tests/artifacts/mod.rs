//! The operator artifacts (`deploy/prometheus/alerts.yml`, `deploy/grafana/slackgate.json`)
//! and the gate's text exposition, read well enough to check one against the other: which
//! families exist with which type and labels, which `slackgate_*` names and labels the queries
//! use, and whether each query applies `rate()` and `histogram_quantile` to the right types.
//! No YAML or PromQL parser: the artifacts are ours and regular, and a query this cannot read
//! still goes through a real Prometheus in the scrape test.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Labels Prometheus attaches to every scraped series.
pub const TARGET_LABELS: [&str; 2] = ["instance", "job"];

/// One metric family of a scrape: its declared type, the label names its samples carry, and
/// how many samples it has.
#[derive(Debug, Default)]
pub struct Family {
    pub kind: String,
    pub labels: BTreeSet<String>,
    pub samples: usize,
}

/// One query of an artifact: where it is (alert or panel), its PromQL, its legend (panels).
#[derive(Debug)]
pub struct Query {
    pub origin: String,
    pub expr: String,
    pub legend: String,
}

/// The families of a text-format scrape, by name; histogram series count under their base name.
pub fn families(text: &str) -> BTreeMap<String, Family> {
    let mut fams: BTreeMap<String, Family> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            let (name, kind) = (it.next().unwrap(), it.next().unwrap());
            fams.entry(name.to_string()).or_default().kind = kind.to_string();
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let end = line.find(['{', ' ']).unwrap_or(line.len());
        let base = family_of(&line[..end], &fams)
            .map(|(b, _)| b.to_string())
            .unwrap_or_else(|| panic!("sample without a TYPE line: {line}"));
        let f = fams.get_mut(&base).unwrap();
        f.samples += 1;
        if let (Some(open), Some(close)) = (line.find('{'), line.rfind('}')) {
            f.labels.extend(label_names(&line[open + 1..close]));
        }
    }
    fams
}

/// The family a series name belongs to: itself, or a histogram's `_bucket`/`_sum`/`_count`.
pub fn family_of<'a>(
    name: &str,
    fams: &'a BTreeMap<String, Family>,
) -> Option<(&'a str, &'a Family)> {
    if let Some((k, f)) = fams.get_key_value(name) {
        return Some((k.as_str(), f));
    }
    ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
        let (k, f) = fams.get_key_value(name.strip_suffix(suffix)?)?;
        (f.kind == "histogram").then_some((k.as_str(), f))
    })
}

/// Label names of one sample's `a="x",b="y"` (values may hold escaped quotes and commas).
fn label_names(inside: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = inside;
    while let Some(eq) = rest.find('=') {
        names.push(rest[..eq].trim_start_matches(',').trim().to_string());
        let value = &rest[eq + 1..];
        let mut escaped = false;
        let mut end = value.len();
        for (i, c) in value.char_indices().skip(1) {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => {
                    end = i + 1;
                    break;
                }
                _ => {}
            }
        }
        rest = &value[end..];
    }
    names
}

/// Every `slackgate_[a-z0-9_]+` token in a text, in order of first appearance: the regex, by
/// hand (no regex crate in this workspace).
pub fn metric_names(text: &str) -> Vec<String> {
    let b = text.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while let Some(pos) = text[i..].find("slackgate_") {
        let start = i + pos;
        let mut end = start + "slackgate_".len();
        while end < b.len()
            && (b[end].is_ascii_lowercase() || b[end].is_ascii_digit() || b[end] == b'_')
        {
            end += 1;
        }
        let name = &text[start..end];
        if (start == 0 || !ident(b[start - 1])) && !out.iter().any(|n| n == name) {
            out.push(name.to_string());
        }
        i = end;
    }
    out
}

/// What is wrong with one query against the exported families: unknown metrics, matchers on
/// labels no series carries, grouping by labels no metric of the query has, `rate()` or
/// `increase()` over a gauge, `histogram_quantile` over anything but buckets, legend labels
/// that do not exist.
pub fn check_query(q: &Query, fams: &BTreeMap<String, Family>) -> Vec<String> {
    let expr = q.expr.as_str();
    let mut problems = Vec::new();
    let mut labels: BTreeSet<String> = TARGET_LABELS.iter().map(|l| l.to_string()).collect();
    for name in metric_names(expr) {
        let Some((_, f)) = family_of(&name, fams) else {
            problems.push(format!("unknown metric {name}"));
            continue;
        };
        labels.extend(f.labels.iter().cloned());
        // The matchers written right after each use of this name.
        for (pos, _) in expr.match_indices(name.as_str()) {
            let after = &expr[pos + name.len()..];
            let Some((inner, _)) = after.strip_prefix('{').and_then(|a| a.split_once('}')) else {
                continue;
            };
            for m in inner.split(',').filter(|m| !m.trim().is_empty()) {
                let l = m.split(['=', '!']).next().unwrap_or("").trim();
                if !f.labels.contains(l) && !TARGET_LABELS.contains(&l) {
                    problems.push(format!("{name} has no label {l:?}"));
                }
            }
        }
    }
    for word in ["by", "without", "on", "ignoring"] {
        for (pos, _) in expr.match_indices(word) {
            let standalone = !expr[..pos]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
            let after = expr[pos + word.len()..].trim_start();
            let Some(grouped) = after.strip_prefix('(').filter(|_| standalone) else {
                continue;
            };
            let grouped = grouped.split(')').next().unwrap_or("");
            for l in grouped.split(',').map(str::trim).filter(|l| !l.is_empty()) {
                if !labels.contains(l) {
                    problems.push(format!("{word} ({l}): no metric of the query has it"));
                }
            }
        }
    }
    for (func, types) in [
        ("rate(", &["counter", "histogram"][..]),
        ("increase(", &["counter", "histogram"][..]),
        ("histogram_quantile(", &["histogram"][..]),
    ] {
        for (pos, _) in expr.match_indices(func) {
            // The first metric after the function's opening parenthesis is its argument.
            let Some(name) = metric_names(&expr[pos..]).into_iter().next() else {
                continue;
            };
            let Some((base, f)) = family_of(&name, fams) else {
                continue;
            };
            let whole_histogram = f.kind == "histogram" && name == base;
            let not_buckets = func == "histogram_quantile(" && !name.ends_with("_bucket");
            if !types.contains(&f.kind.as_str()) || whole_histogram || not_buckets {
                problems.push(format!("{func}{name}..): {base} is a {}", f.kind));
            }
        }
    }
    for part in q.legend.split("{{").skip(1) {
        let l = part.split("}}").next().unwrap_or("").trim();
        if !labels.contains(l) {
            problems.push(format!("legend {{{{{l}}}}}: no such label"));
        }
    }
    problems
}

/// A file of the repository, by its path from the root.
pub fn read_repo_file(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The dashboard, parsed by a strict JSON parser (it rejects what `python3 -m json.tool`
/// rejects: trailing commas, comments, bare words).
pub fn dashboard() -> Value {
    serde_json::from_str(&read_repo_file("deploy/grafana/slackgate.json"))
        .unwrap_or_else(|e| panic!("deploy/grafana/slackgate.json is not valid JSON: {e}"))
}

/// Every query of every panel of the dashboard, rows included.
pub fn dashboard_queries(d: &Value) -> Vec<Query> {
    fn walk(panels: &Value, out: &mut Vec<Query>) {
        for p in panels.as_array().into_iter().flatten() {
            let origin = format!("panel {:?}", p["title"].as_str().unwrap_or("?"));
            for t in p["targets"].as_array().into_iter().flatten() {
                out.push(Query {
                    origin: origin.clone(),
                    expr: t["expr"].as_str().unwrap_or("").to_string(),
                    legend: t["legendFormat"].as_str().unwrap_or("").to_string(),
                });
            }
            walk(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&d["panels"], &mut out);
    assert!(
        out.len() >= 10,
        "only {} dashboard queries found",
        out.len()
    );
    out
}

/// The `expr` of every rule in alerts.yml; `expr: |` blocks are read to their end.
pub fn alert_queries() -> Vec<Query> {
    let text = read_repo_file("deploy/prometheus/alerts.yml");
    let lines: Vec<&str> = text.lines().collect();
    let indent = |l: &str| l.len() - l.trim_start().len();
    let mut out = Vec::new();
    let mut alert = "";
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        if let Some(name) = t.strip_prefix("- alert:") {
            alert = name.trim();
        }
        let Some(v) = t.strip_prefix("expr:").map(str::trim) else {
            continue;
        };
        let expr = if v.starts_with('|') || v.starts_with('>') {
            lines[i + 1..]
                .iter()
                .take_while(|l| l.trim().is_empty() || indent(l) > indent(line))
                .map(|l| l.trim())
                .collect::<Vec<_>>()
                .join("\n")
        } else {
            v.trim_matches(|c| c == '\'' || c == '"').to_string()
        };
        out.push(Query {
            origin: format!("alert {alert}"),
            expr,
            legend: String::new(),
        });
    }
    let rules = lines
        .iter()
        .filter(|l| l.trim_start().starts_with("- alert:"))
        .count();
    assert!(
        rules >= 10 && out.len() == rules,
        "{} exprs for {rules} alerts",
        out.len()
    );
    out
}

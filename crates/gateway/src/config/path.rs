//! Name the field a TOML error is about.
//!
//! The TOML deserializer reports *where* a bad value is (a byte span) and *what* is wrong,
//! but not the field's path. An operator at 02:14 wants `classes[1].deadline_ms`, the same
//! shape the semantic checks use (`classes[1].pool`), so the span is mapped back onto the
//! document's structure here: the innermost key, value or table whose span holds it.

use toml_edit::{ImDocument, Item, Table, Value};

/// The path (`classes[1].deadline_ms`) of the item at byte `pos` of `text`, if any.
pub fn locate(text: &str, pos: usize) -> Option<String> {
    let doc = ImDocument::parse(text).ok()?;
    let mut best = None;
    walk_table(doc.as_table(), "", pos, &mut best);
    best
}

/// `line:column` (1-based) of byte `pos` of `text`.
pub fn line_col(text: &str, pos: usize) -> (usize, usize) {
    let before = text.get(..pos.min(text.len())).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

fn contains(span: Option<std::ops::Range<usize>>, pos: usize) -> bool {
    span.is_some_and(|s| s.start <= pos && pos < s.end.max(s.start + 1))
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

fn walk_table(t: &Table, prefix: &str, pos: usize, best: &mut Option<String>) {
    for (k, item) in t.iter() {
        let path = join(prefix, k);
        let key_span = t.key(k).and_then(|k| k.span());
        if contains(key_span, pos) {
            *best = Some(path.clone());
        }
        match item {
            Item::Table(sub) => {
                if contains(sub.span(), pos) {
                    *best = Some(path.clone());
                }
                walk_table(sub, &path, pos, best);
            }
            Item::ArrayOfTables(a) => {
                for (i, sub) in a.iter().enumerate() {
                    let p = format!("{path}[{i}]");
                    if contains(sub.span(), pos) {
                        *best = Some(p.clone());
                    }
                    walk_table(sub, &p, pos, best);
                }
            }
            Item::Value(v) => walk_value(v, &path, pos, best),
            Item::None => {}
        }
    }
}

fn walk_value(v: &Value, path: &str, pos: usize, best: &mut Option<String>) {
    if contains(v.span(), pos) {
        *best = Some(path.to_string());
    }
    match v {
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                walk_value(x, &format!("{path}[{i}]"), pos, best);
            }
        }
        Value::InlineTable(t) => {
            for (k, x) in t.iter() {
                let p = join(path, k);
                if contains(t.key(k).and_then(|k| k.span()), pos) {
                    *best = Some(p.clone());
                }
                walk_value(x, &p, pos, best);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_fields_in_arrays_of_tables_and_inline_tables() {
        let text = "[server]\nlisten = \"x\"\n[[classes]]\nname = \"a\"\n[[classes]]\nname = \"b\"\ndeadline_ms = \"soon\"\n[ledger]\ngrants = { \"k:1\" = -5 }\n";
        let at = |needle: &str| text.find(needle).map(|p| locate(text, p)).unwrap_or(None);
        assert_eq!(at("\"soon\"").as_deref(), Some("classes[1].deadline_ms"));
        assert_eq!(at("deadline_ms").as_deref(), Some("classes[1].deadline_ms"));
        assert_eq!(at("\"x\"").as_deref(), Some("server.listen"));
        assert_eq!(at("-5").as_deref(), Some("ledger.grants.k:1"));
        assert_eq!(line_col(text, text.find("\"soon\"").unwrap_or(0)), (7, 15));
        assert_eq!(locate("not = = toml", 3), None);
    }
}

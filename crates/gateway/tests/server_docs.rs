//! Every configuration in docs/servers/*.md (one page per server kind) parses and passes the
//! gate's checks, and each page names the gauges the gate really reads for its kind: a server
//! page whose config does not load, or that documents other gauge names than the built-in
//! ones, is wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use slackgate_core::config::ServerKind;
use slackgate_gateway::Config;

/// The ```toml blocks of a markdown text.
fn toml_blocks(md: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur: Option<String> = None;
    for line in md.lines() {
        match (&mut cur, line.trim()) {
            (None, "```toml") => cur = Some(String::new()),
            (Some(block), "```") => {
                out.push(std::mem::take(block));
                cur = None;
            }
            (Some(block), _) => {
                block.push_str(line);
                block.push('\n');
            }
            (None, _) => {}
        }
    }
    assert!(cur.is_none(), "an unclosed ```toml block");
    out
}

fn page(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../docs/servers")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn every_server_page_config_loads() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/servers");
    let mut pages = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "md") {
            continue;
        }
        pages += 1;
        let md = std::fs::read_to_string(&path).unwrap();
        let blocks = toml_blocks(&md);
        assert!(!blocks.is_empty(), "{}: no ```toml config", path.display());
        for (i, b) in blocks.iter().enumerate() {
            let at = format!("{} block {}", path.display(), i + 1);
            let cfg = Config::from_toml(b).unwrap_or_else(|e| panic!("{at}: {e}"));
            cfg.validate_shape().unwrap_or_else(|e| panic!("{at}: {e}"));
            for (j, p) in cfg.gate.pools.iter().enumerate() {
                let eps = p.endpoint_list();
                assert!(
                    !eps.is_empty(),
                    "{at}: pools[{j}] has no upstream or endpoints"
                );
                for e in eps {
                    assert!(
                        e.url.starts_with("http://") || e.url.starts_with("https://"),
                        "{at}: {}",
                        e.url
                    );
                }
            }
        }
    }
    assert!(
        pages >= 5,
        "expected a page per server kind in {}",
        dir.display()
    );
}

#[test]
fn each_page_names_its_kinds_gauges() {
    for (file, kind) in [
        ("llamacpp.md", ServerKind::Llamacpp),
        ("vllm.md", ServerKind::Vllm),
        ("tgi.md", ServerKind::Tgi),
        ("sglang.md", ServerKind::Sglang),
    ] {
        let md = page(file);
        let (running, waiting) = kind.gauges().unwrap();
        assert!(md.contains(&format!("`{running}`")), "{file}: {running}");
        assert!(md.contains(&format!("`{waiting}`")), "{file}: {waiting}");
        // Its config turns the signal on with its own kind.
        let on = toml_blocks(&md).iter().any(|b| {
            Config::from_toml(b).is_ok_and(|c| {
                c.gate
                    .pools
                    .iter()
                    .any(|p| p.server_metrics.as_ref().is_some_and(|m| m.kind == kind))
            })
        });
        assert!(on, "{file}: no config with server_metrics kind {kind:?}");
    }
    // A hosted API exports no queue: its page must not configure a scrape.
    let md = page("hosted-api.md");
    for b in toml_blocks(&md) {
        let c = Config::from_toml(&b).unwrap();
        assert!(c.gate.pools.iter().all(|p| p.server_metrics.is_none()));
    }
}

#[test]
fn block_extraction_handles_hostile_markdown() {
    assert!(toml_blocks("no code at all").is_empty());
    assert_eq!(toml_blocks("```toml\na = 1\n```\n```sh\nx\n```\n").len(), 1);
    assert!(std::panic::catch_unwind(|| toml_blocks("```toml\na = 1\n")).is_err());
    // A malformed block is reported, not accepted.
    assert!(Config::from_toml("[[pools]\nname = ").is_err());
}

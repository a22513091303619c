//! Every shipped example configuration parses and validates: docs that do not run are wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use slackgate_gateway::Config;

#[test]
fn shipped_examples_are_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/examples");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let cfg =
                Config::from_file(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            cfg.validate()
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            n += 1;
        }
    }
    assert!(n >= 3, "expected the example configs in {}", dir.display());
}

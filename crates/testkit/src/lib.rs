//! Test support shared by slackgate's crates (a dev-dependency only, never shipped).
//!
//! Some tests need something the repository does not hold: the production trace the simulator
//! replays (users bring their own; it lives beside the checkout) or a `prometheus` binary. When
//! it is missing, such a test must neither fail for a reason unrelated to the code nor pass
//! silently. It calls [`skip`] (or a finder here that does), which
//!
//! - writes `SKIPPED <test>: <reason>` straight to the process's standard error, past the test
//!   harness's output capture, so the line shows in a plain `cargo test`;
//! - appends the same line to the file named by `SLACKGATE_SKIP_LOG`, when set, so that
//!   `scripts/test.sh` can count and list the skips at the end of a run;
//! - panics instead when `SLACKGATE_FORBID_SKIPS` is set to anything but empty or `0`, which CI
//!   does: there the trace and the tools are supposed to be present, so a skip is a failure.
//!
//! It also starts real servers for integration tests: [`RedisServer`] (a `redis-server` of
//! the test's own on a free loopback port); and makes scratch directories no two tests share
//! ([`temp_dir`], [`TempDir`]).
#![forbid(unsafe_code)]

mod redis;
pub use redis::{RedisOptions, RedisServer, REDIS_SERVER_VAR};

mod scratch;
pub use scratch::{temp_dir, unique_path, TempDir};

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

/// File name of the production trace (Azure LLM inference, 2023, code) the simulator's
/// published figures come from.
pub const TRACE_FILE: &str = "azure_llm_2023_code.csv";

/// Environment variable naming a directory that holds [`TRACE_FILE`].
pub const TRACES_VAR: &str = "SLACKGATE_TRACES";

/// Environment variable naming the file each skip is appended to.
pub const SKIP_LOG_VAR: &str = "SLACKGATE_SKIP_LOG";

/// Environment variable that turns every skip into a failure (CI sets it).
pub const FORBID_VAR: &str = "SLACKGATE_FORBID_SKIPS";

/// Report `test` as skipped for `reason`: to standard error, to `$SLACKGATE_SKIP_LOG`, or as
/// a panic when `$SLACKGATE_FORBID_SKIPS` is set. The caller returns right after.
pub fn skip(test: &str, reason: &str) {
    if forbidden(std::env::var_os(FORBID_VAR)) {
        panic!("{test} cannot run: {reason} ({FORBID_VAR} is set: nothing may be skipped here)");
    }
    let line = skip_line(test, reason);
    // Not `eprintln!`: the harness captures that and shows it only for failing tests.
    let _ = writeln!(std::io::stderr(), "{line}");
    if let Some(log) = std::env::var_os(SKIP_LOG_VAR).filter(|v| !v.is_empty()) {
        if let Err(e) = append(Path::new(&log), &line) {
            let _ = writeln!(
                std::io::stderr(),
                "(could not add it to {SKIP_LOG_VAR}={}: {e})",
                Path::new(&log).display()
            );
        }
    }
}

/// The production trace, or `None` after reporting `test` as skipped (see [`skip`]). Looked
/// for in `$SLACKGATE_TRACES`, then in `../shared/traces` beside the repository (where the
/// scenarios' relative `[trace] path` points).
pub fn production_trace(test: &str) -> Option<PathBuf> {
    match locate_trace(std::env::var_os(TRACES_VAR), &repo_root()) {
        Ok(path) => Some(path),
        Err(reason) => {
            skip(test, &reason);
            None
        }
    }
}

/// An executable `name` on `PATH`, or `None` after reporting `test` as skipped with the
/// Debian package that provides it.
pub fn on_path(test: &str, name: &str, debian_package: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|p| find_in(&p, name));
    if found.is_none() {
        skip(
            test,
            &format!(
                "no `{name}` on PATH; install it with `apt-get install -y {debian_package}` \
                 (scripts/test.sh does that when run as root)"
            ),
        );
    }
    found
}

/// The repository's root directory (this crate is `crates/testkit` in it).
pub fn repo_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent()
        .and_then(Path::parent)
        .unwrap_or(here)
        .to_path_buf()
}

/// Where the trace is given `$SLACKGATE_TRACES` (`env`) and the repository root, or why it
/// is not there: each place looked at and how to supply it.
fn locate_trace(env: Option<OsString>, root: &Path) -> Result<PathBuf, String> {
    let beside = root.parent().unwrap_or(root).join("shared").join("traces");
    let mut places = Vec::new();
    if let Some(dir) = env.filter(|d| !d.is_empty()) {
        places.push((
            format!("{TRACES_VAR}={}", Path::new(&dir).display()),
            dir.into(),
        ));
    }
    places.push(("beside the repository".to_string(), beside));
    for (_, dir) in &places {
        let path: PathBuf = Path::new(dir).join(TRACE_FILE);
        if path.is_file() {
            return Ok(path);
        }
    }
    let looked: Vec<String> = places
        .iter()
        .map(|(how, dir)| format!("{} ({how})", Path::new(dir).join(TRACE_FILE).display()))
        .collect();
    Err(format!(
        "the production trace {TRACE_FILE} is not at {}; set {TRACES_VAR}=DIR to the \
         directory that holds it",
        looked.join(" nor at ")
    ))
}

/// The one line a skip is reported with.
fn skip_line(test: &str, reason: &str) -> String {
    format!("SKIPPED {test}: {reason}")
}

/// Whether the value of `$SLACKGATE_FORBID_SKIPS` forbids skipping.
fn forbidden(value: Option<OsString>) -> bool {
    value.is_some_and(|v| !v.is_empty() && v != "0")
}

/// Append `line` to `log`. One `write` of the whole line to a file opened for appending, so
/// the lines of tests running in parallel (threads or processes) do not interleave.
fn append(log: &Path, line: &str) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    f.write_all(format!("{line}\n").as_bytes())
}

/// `name` in one of the directories of a `PATH`-style list, if it is a file there.
fn find_in(path_list: &OsString, name: &str) -> Option<PathBuf> {
    std::env::split_paths(path_list)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Read an HTTP/1.1 request head (up to and including the blank line, at most 64 KiB) byte by
/// byte from a fake upstream's accepted connection, so the body stays unread on the socket.
/// Ends early (with what it has) on a read error, a timeout or the peer closing.
pub fn read_request_head(s: &mut impl std::io::Read) -> String {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") && buf.len() < 65_536 {
        match s.read(&mut byte) {
            Ok(1) => buf.push(byte[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&buf).to_string()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// A fresh scratch directory under the system's temporary directory (one per test name
    /// and process: the tests here use distinct names).
    fn scratch(name: &str) -> PathBuf {
        let pid = std::process::id();
        let d = std::env::temp_dir().join(format!("slackgate-testkit-{name}-{pid}"));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn the_trace_is_found_in_the_variable_first_then_beside_the_repository() {
        let root = scratch("root");
        let repo = root.join("repo");
        let beside = root.join("shared/traces");
        let elsewhere = root.join("elsewhere");
        for d in [&repo, &beside, &elsewhere] {
            std::fs::create_dir_all(d).unwrap();
        }
        // Neither: the reason names both places and the variable to set.
        let err = locate_trace(Some(elsewhere.clone().into()), &repo).unwrap_err();
        assert!(err.contains(&format!("{TRACES_VAR}=DIR")), "{err}");
        assert!(
            err.contains(&elsewhere.join(TRACE_FILE).display().to_string()),
            "{err}"
        );
        assert!(err.contains("beside the repository"), "{err}");
        // Beside the repository only.
        std::fs::write(beside.join(TRACE_FILE), "x").unwrap();
        let found = locate_trace(Some(elsewhere.clone().into()), &repo).unwrap();
        assert_eq!(found, beside.join(TRACE_FILE));
        assert!(locate_trace(None, &repo).is_ok());
        assert!(locate_trace(Some(OsString::new()), &repo).is_ok());
        // In the variable's directory too: that one wins.
        std::fs::write(elsewhere.join(TRACE_FILE), "y").unwrap();
        let found = locate_trace(Some(elsewhere.clone().into()), &repo).unwrap();
        assert_eq!(found, elsewhere.join(TRACE_FILE));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn skips_are_one_line_each_appended_to_the_log() {
        let dir = scratch("log");
        let log = dir.join("skips.txt");
        append(&log, &skip_line("a::one", "no trace")).unwrap();
        append(&log, &skip_line("b::two", "no prometheus")).unwrap();
        let text = std::fs::read_to_string(&log).unwrap();
        assert_eq!(
            text,
            "SKIPPED a::one: no trace\nSKIPPED b::two: no prometheus\n"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn only_a_non_empty_value_other_than_zero_forbids_skips() {
        assert!(!forbidden(None));
        assert!(!forbidden(Some("".into())));
        assert!(!forbidden(Some("0".into())));
        assert!(forbidden(Some("1".into())));
        assert!(forbidden(Some("true".into())));
    }

    #[test]
    fn executables_are_found_on_a_path_list() {
        let dir = scratch("path");
        std::fs::write(dir.join("tool"), "").unwrap();
        let list = std::env::join_paths([Path::new("/nonexistent-dir"), &dir]).unwrap();
        assert_eq!(find_in(&list, "tool"), Some(dir.join("tool")));
        assert_eq!(find_in(&list, "other"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_repository_root_holds_the_workspace_manifest() {
        let text = std::fs::read_to_string(repo_root().join("Cargo.toml")).unwrap();
        assert!(text.contains("[workspace]"), "{text}");
    }
}

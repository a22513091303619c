//! `slackgate check FILE`: the file as a plain argument, as every such command takes it, with
//! the older `--config FILE` still accepted. Both or neither is a usage error (exit 2) rather
//! than a guess; a bad file named either way fails the same way, naming the field.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::{Command, Output};

fn temp_file(name: &str, text: &str) -> PathBuf {
    let dir = slackgate_testkit::temp_dir("check-cli");
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn check(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_slackgate"))
        .arg("check")
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap()
}

const GOOD: &str = "[[pools]]\nname = \"gpu\"\nslots = 4\n[[classes]]\nname = \"interactive\"\npool = \"gpu\"\npriority = 100\ndeadline_ms = 20000\n";

#[test]
fn the_file_is_a_plain_argument_and_config_still_works() {
    let good = temp_file("good.toml", GOOD);
    let plain = check(&[good.as_os_str()]);
    let text = String::from_utf8_lossy(&plain.stdout).to_string();
    assert!(plain.status.success(), "{plain:?}");
    assert!(text.contains(": ok (1 pools, 1 classes)"), "{text}");
    assert!(text.contains("class interactive"), "{text}");

    let flag = check(&["--config".as_ref(), good.as_os_str()]);
    assert!(flag.status.success(), "{flag:?}");
    assert_eq!(String::from_utf8_lossy(&flag.stdout), text, "same report");

    // Every example config shipped in deploy/examples passes, named plainly.
    let examples = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy/examples");
    for entry in std::fs::read_dir(&examples).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let out = check(&[path.as_os_str()]);
            assert!(out.status.success(), "{}: {out:?}", path.display());
        }
    }
    let _ = std::fs::remove_dir_all(good.parent().unwrap());
}

#[test]
fn both_neither_or_a_bad_file_fail_clearly() {
    let good = temp_file("good.toml", GOOD);
    let both = check(&[good.as_os_str(), "--config".as_ref(), good.as_os_str()]);
    assert_eq!(both.status.code(), Some(2), "{both:?}");
    let err = String::from_utf8_lossy(&both.stderr);
    assert!(err.contains("cannot be used with"), "{err}");

    let neither = check(&[]);
    assert_eq!(neither.status.code(), Some(2), "{neither:?}");
    let err = String::from_utf8_lossy(&neither.stderr);
    assert!(err.contains("FILE"), "{err}");

    let bad = temp_file(
        "bad.toml",
        "[[classes]]\nname = \"a\"\ndeadline_ms = \"soon\"\n",
    );
    for args in [
        vec![bad.as_os_str()],
        vec!["--config".as_ref(), bad.as_os_str()],
    ] {
        let out = check(&args);
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("classes[0].deadline_ms"), "{err}");
    }

    let missing = good.with_file_name("missing.toml");
    let out = check(&[missing.as_os_str()]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("missing.toml"),
        "{out:?}"
    );
    let _ = std::fs::remove_dir_all(good.parent().unwrap());
    let _ = std::fs::remove_dir_all(bad.parent().unwrap());
}

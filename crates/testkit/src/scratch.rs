//! Scratch directories for tests: one of a test's own, never shared with another test of the
//! same run (tests run in parallel), nor with an earlier run.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A path under the system's temporary directory that no other call of this process, and no
/// earlier process, gets: `slackgate-<name>-<pid>-<nanoseconds>-<counter>`. Nothing is made.
pub fn unique_path(name: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::env::temp_dir().join(format!(
        "slackgate-{name}-{}-{nanos}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// A new directory at a [`unique_path`], kept after the test (to look at when it fails).
///
/// # Panics
/// When the directory cannot be made: the test cannot run.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = unique_path(name);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        panic!("cannot make the scratch directory {}: {e}", dir.display());
    }
    dir
}

/// A new directory at a [`unique_path`], removed with everything in it when dropped.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// Make the directory (see [`temp_dir`], which panics when it cannot).
    pub fn new(name: &str) -> TempDir {
        TempDir(temp_dir(name))
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// A path inside the directory.
    pub fn join(&self, part: impl AsRef<Path>) -> PathBuf {
        self.0.join(part)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn scratch_directories_are_distinct_and_a_temp_dir_is_removed_when_dropped() {
        let (a, b) = (TempDir::new("scratch"), TempDir::new("scratch"));
        assert_ne!(a.path(), b.path(), "two calls in one instant still differ");
        assert!(a.path().is_dir() && b.path().is_dir());
        let inside = a.join("f");
        std::fs::write(&inside, "x").unwrap();
        let kept = a.path().to_path_buf();
        drop(a);
        assert!(!kept.exists(), "removed with what was in it");
        assert!(b.path().is_dir(), "the other is untouched");
        let plain = temp_dir("scratch");
        assert!(plain.is_dir());
        let _ = std::fs::remove_dir_all(plain);
    }
}

//! How a SQLite failure becomes a [`StoreError`] an operator can act on. Shared by the code
//! that opens the file (`sqlite.rs`) and the writer thread (`writer.rs`), so neither has to
//! reach into the other.

use super::StoreError;
use rusqlite::ErrorCode;
use std::path::Path;

/// Turn a SQLite error into the store error an operator can act on.
pub(super) fn classify(path: &Path, op: &'static str, source: rusqlite::Error) -> StoreError {
    let path = path.to_owned();
    match source.sqlite_error_code() {
        Some(ErrorCode::NotADatabase | ErrorCode::DatabaseCorrupt) => {
            StoreError::NotADatabase { path }
        }
        Some(ErrorCode::CannotOpen) => StoreError::Open {
            path,
            reason: format!("{source} (check the directory exists and is writable)"),
        },
        Some(ErrorCode::ReadOnly | ErrorCode::PermissionDenied) => StoreError::Open {
            path,
            reason: format!("not writable: {source}"),
        },
        _ => StoreError::Sqlite { path, op, source },
    }
}

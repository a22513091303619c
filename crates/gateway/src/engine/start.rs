//! Why a gate could not start: one typed error for building its state and starting its
//! listeners, each variant with the message an operator reads (the CLI prints it).

use crate::engine::replica::LeaseStartError;
use crate::ledger_store::StoreError;
use slackgate_core::ConfigError;

/// Why a gate could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The listener's address could not be read.
    #[error("{0}")]
    Listener(#[from] std::io::Error),
    /// A pool's upstream clients could not be built (TLS roots, credentials).
    #[error("{0}")]
    Transports(crate::upstream::TransportError),
    /// The ledger store could not be read at start.
    #[error("cannot load the ledger: {0}")]
    LoadLedger(Box<StoreError>),
    /// A pool names no upstream at all (the config field given).
    #[error("{0}: missing")]
    NoUpstream(String),
    /// A pool's upstream URL does not parse (`at` names the field).
    #[error("{at}: {why}")]
    Upstream {
        /// The config field.
        at: String,
        /// Why it does not parse.
        why: crate::wire::url::UrlError,
    },
    /// `server.tenant_hash_key` is not a key.
    #[error("server.tenant_hash_key: {0}")]
    TenantKey(crate::support::tenant::BadKey),
    /// A cluster's tenant hash key could not be read from Redis.
    #[error(
        "cannot read the cluster's tenant hash key from Redis: {0} (set \
         server.tenant_hash_key on every replica to start without Redis)"
    )]
    ClusterTenantKey(Box<StoreError>),
    /// The store's tenant hash key could not be read.
    #[error("cannot read the tenant hash key: {0}")]
    StoreTenantKey(Box<StoreError>),
    /// The `[cluster]` section cannot work on this listener.
    #[error("{0}")]
    Cluster(slackgate_core::ConfigError),
    /// The cluster's lease thread could not start.
    #[error(transparent)]
    Lease(#[from] LeaseStartError),
    /// The admin token from the environment is unusable.
    #[error("{0}")]
    AdminToken(crate::engine::controls::TokenError),
    /// The cluster's shared ledger could not be opened.
    #[error("cannot open the cluster's ledger: {0}")]
    OpenClusterLedger(Box<StoreError>),
    /// The SQLite ledger could not be opened.
    #[error("cannot open the ledger {spec:?}: {why}")]
    OpenLedger {
        /// `server.ledger`.
        spec: String,
        /// Why not.
        why: Box<StoreError>,
    },
}

/// For callers that keep errors as text (tests, the drill).
impl From<StartError> for String {
    fn from(e: StartError) -> String {
        e.to_string()
    }
}

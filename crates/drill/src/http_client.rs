//! The one HTTP client the drill's requests share (the simulated clients, the probes of a
//! real server, the stub's control calls).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;

/// The HTTP client every drill request shares.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Build the shared client: no idle-connection cap, TCP_NODELAY.
pub fn http_client() -> HttpClient {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.set_connect_timeout(Some(Duration::from_secs(5)));
    Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(2))
        .build(http)
}

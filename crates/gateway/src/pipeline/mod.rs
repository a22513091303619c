//! The request path: a chat completion (or any admission-controlled `POST /v1/...`) in named
//! phases ([`proxy`]), the reservation API ([`admission_api`]), and the pass-through of
//! everything else under `/v1` ([`passthrough`]).

pub mod admission_api;
mod arrival;
mod exchange;
pub mod passthrough;
pub mod proxy;
mod settle;
mod slot;

//! The request path: a chat completion, and the reservation API.

pub mod admission_api;
pub mod proxy;

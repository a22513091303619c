//! What crosses the wire: what a request asks for and every response the gate writes.

pub mod headers;
pub mod labels;
pub mod request_info;
pub mod response;
pub mod url;

//! Below everything: the clock and keyed tenant ids.

pub mod clock;
pub mod tenant;

//! The admission policies the simulator compares: slackgate's core, the baselines people use
//! today, and the clairvoyant reference.

pub mod clairvoyant;
pub mod codel;
pub mod fifo;
pub mod gradient;
pub(crate) mod job_queue;
pub mod seed000;
pub mod slackgate;

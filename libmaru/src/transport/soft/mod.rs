//! `soft`: a software NIC over TCP. The agent hosts a [`SoftTarget`] that serves
//! one-sided READ/WRITE against its registration table and checks the remote key on
//! every operation; workers use a [`SoftTransport`]. It lets the whole system run on
//! any Linux host (loopback or network namespaces) with the same rules as RDMA.

mod lane;
pub mod proto;
mod target;
mod worker;

pub use target::{SoftTarget, TargetStats};
pub use worker::SoftTransport;

#[cfg(test)]
mod tests;

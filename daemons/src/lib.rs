//! The daemons' thin shells: flag parsing helpers and the `net::Service` adapters
//! that put each sans-I/O core from `maru` on the event loop.

pub mod agent_service;
pub mod common;
pub mod meta_agents;
pub mod meta_rm;
pub mod meta_service;
pub mod meta_store;
pub mod meta_watch;
pub mod metrics;
pub mod metrics_http;
pub mod off_loop;
pub mod peer_calls;
pub mod request;
pub mod rm_service;
pub mod rm_tables;
pub mod session_binding;
pub mod tenants_file;

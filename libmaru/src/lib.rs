pub mod agent;
pub mod auth;
pub mod dax;
pub mod ffi;
pub mod net;
pub mod rm;
pub mod transport;
pub mod wire;

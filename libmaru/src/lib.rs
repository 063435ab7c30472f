pub mod agent;
pub mod auth;
pub mod dax;
#[allow(clippy::disallowed_methods)] // the C boundary: its tests start threads
pub mod ffi;
pub mod logging;
pub mod meta;
#[allow(clippy::disallowed_methods)] // a driver: the event loop, clients and sockets
pub mod net;
pub mod rm;
#[cfg(test)]
pub(crate) mod test_alloc;
#[cfg(any(test, feature = "test-hooks"))]
pub mod testing;
pub mod transport;
pub mod wire;
pub mod worker;

/// The test binary counts each thread's allocations (`test_alloc`).
#[cfg(test)]
#[global_allocator]
static ALLOCATOR: test_alloc::Counting = test_alloc::Counting;

//! The C ABI of libmaru.so, described by the generated `include/maru.h`.
//!
//! One file per C type or group, in the order the header lists them:
//! [`version`] (which library is loaded), [`error`] (last error text), [`log`]
//! (where messages go), [`hook`] (pinning the staging buffer), [`handler`] (open,
//! stats, shutdown, free), [`kv`] (chunks by key), [`pieces`] (chunks by key copied
//! in pieces into a paged cache), [`slots`] (zero-copy staging
//! slots), [`ops`] (asynchronous slot transfers), [`views`] (chunks in place on
//! `cxl`), [`keys`] (chunk keys), [`key_file`] (checking a key file), [`copy`]
//! (copies between a runtime's memory and Maru's). [`status`]
//! holds the one table from libmaru's errors to status codes; [`boundary`] and
//! [`args`] the rules every function keeps.
//!
//! Rules every exported function follows (rustls-ffi style):
//!
//! - `#[no_mangle] pub extern "C"`, one function per operation, with doc comments
//!   written for C callers in plain prose (ownership, threads): cbindgen copies them
//!   into the header, so the header is the documentation.
//! - The body runs inside [`boundary::ffi_guard`] (or `ffi_guard_value`): no panic
//!   crosses into C; a panic becomes `MARU_ERR_PANIC`.
//! - A fallible call returns a [`maru_status_t`]; its message is in
//!   `maru_last_error()` on the same thread. Success clears that message.
//! - Pointer arguments are checked for NULL before use (`MARU_ERR_NULL_ARGUMENT`
//!   naming the argument); an array with a count of 0 may be NULL ([`args`]).
//! - A call on a handler holds a reference to it for its duration
//!   ([`handler::with_handler`]), so a concurrent shutdown never frees memory in use.
//! - Enum parameters arrive as their integer (`SlotPoolArg`, `LogLevelArg`,
//!   `StatusArg`), which the header spells as the enum type: C may pass any value,
//!   and an invalid one is an error, never undefined behaviour.
//!
//! - The caller's obligations (what a pointer must point to, who owns what, which
//!   threads may call) are written as "Ownership:" and "Threads:" prose for C readers,
//!   not as Rust `# Safety` headings, hence the `missing_safety_doc` allowance below.
//!
//! After adding or changing an exported item, regenerate the header with
//! `make header` (the `header` integration test fails while it is stale).

#![allow(clippy::missing_safety_doc)]

// The order of these declarations is the order of the header (cbindgen follows it),
// so each is its own group for rustfmt, which would sort them otherwise.

// Which library is loaded.
pub mod version;

// The text behind a status.
pub mod error;
pub mod last_error;

// Where libmaru's messages go.
pub mod log;

// Pinning the staging buffer: set before opening handlers.
pub mod hook;

// A handler: open, stats, shutdown, free.
pub mod handler;

// Chunks by key through the caller's buffers.
pub mod kv;

// Chunks by key copied in pieces into the caller's memory (a paged KV cache).
pub mod pieces;

// Zero-copy staging slots.
pub mod slots;

// Asynchronous slot transfers.
pub mod ops;

// Chunks read in place (cxl).
pub mod views;

// Chunks written in place, and region views (cxl).
pub mod in_place;

// Where the staging buffer lies, for runtimes that hand its slots out as pages.
pub mod staging;

// Chunk keys (no handler needed).
pub mod keys;

// Checking a key file before a handler proves it (no handler needed).
pub mod key_file;

// Copies between a runtime's memory and Maru's (no handler needed).
pub mod copy;

// The rules every function keeps.
pub mod args;
pub mod boundary;
mod calls;
pub mod status;

pub use boundary::{ffi_guard, ffi_guard_value, FfiError};
pub use copy::{maru_copy, maru_copy_t};
pub use error::{clear_last_error, last_error, set_last_error};
pub use handler::{
    maru_chunk_size, maru_handler_close, maru_handler_free, maru_handler_open,
    maru_handler_shutdown, maru_handler_t, maru_stats_json,
};
pub use hook::{maru_set_memory_hook, maru_set_memory_hook_auto};
pub use in_place::{
    maru_page_t, maru_pages_give_back, maru_pages_publish, maru_pages_take, maru_region_t,
    maru_region_view, maru_regions_list,
};
pub use key_file::maru_key_file_check;
pub use keys::{maru_chunk_keys, MARU_CHUNK_KEY_SIZE};
pub use kv::{
    maru_exists, maru_exists_batch, maru_load, maru_load_batch, maru_pin_batch, maru_remove_batch,
    maru_remove_result_t, maru_store, maru_store_batch, maru_unpin_batch,
};
pub use last_error::{maru_last_error, maru_last_error_copy, maru_status_str};
pub use log::{maru_log_level_t, maru_set_log_callback, LogLevelArg};
pub use ops::{
    maru_op_free, maru_op_poll, maru_op_results, maru_op_t, maru_op_wait, maru_submit_load_slots,
    maru_submit_store_slots,
};
pub use pieces::{maru_load_pieces, maru_piece_t};
pub use slots::{
    maru_load_slots, maru_slot_pool_t, maru_slot_t, maru_slots_acquire, maru_slots_held,
    maru_slots_release, maru_store_slots, SlotPoolArg,
};
pub use staging::{maru_staging_buffer, maru_staging_t};
pub use status::{maru_status_t, StatusArg};
pub use version::{maru_abi_version, maru_version_string, MARU_ABI_VERSION};
pub use views::{maru_view_t, maru_views_acquire, maru_views_release};

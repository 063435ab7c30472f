//! Logging: where libmaru's messages go. Without a callback they go to stderr,
//! filtered by the environment variable `MARU_LOG` (else `RUST_LOG`; `env_logger`
//! syntax, e.g. `info` or `maru::worker=debug`), warnings and errors by default.

use super::boundary::ffi_guard;
use super::status::maru_status_t;
use crate::logging::{set_sink, Sink};
use log::LevelFilter;
use std::ffi::{c_char, c_void, CString};

/// The level of a log message, most severe first.
#[allow(non_camel_case_types)]
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum maru_log_level_t {
    /// Nothing (as a minimum level: no message is passed on).
    MARU_LOG_OFF = 0,
    /// What a person must fix: a failed open (a configuration, a key, a refusal).
    MARU_LOG_ERROR = 1,
    /// Degraded but going on: a pool, an agent or a session unavailable, stores
    /// skipped and loads missing because of it (at most one line per cause and pool or
    /// agent every 10 s), a memory node rebooted, the memory hook failed.
    MARU_LOG_WARN = 2,
    /// Lifecycle: a handler opened and closed, a pool's session opened or going on
    /// after maru-server restarted, regions mapped and given back, an agent restarted,
    /// the memory hook's result.
    MARU_LOG_INFO = 3,
    /// Per-call detail for troubleshooting: each call's kind, chunks, time, error.
    MARU_LOG_DEBUG = 4,
    /// Everything.
    MARU_LOG_TRACE = 5,
}

/// A `maru_log_level_t` as C passes it: any 32-bit value, checked before use. The
/// header spells it `maru_log_level_t`.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogLevelArg(pub u32);

impl From<maru_log_level_t> for LogLevelArg {
    fn from(l: maru_log_level_t) -> LogLevelArg {
        LogLevelArg(l as u32)
    }
}

/// `fn(ctx, level, target, message)`: one log message. `target` names the part of
/// libmaru that logged it (such as "maru::worker::pool"); both strings are
/// NUL-terminated and valid only during the call.
#[allow(non_camel_case_types)]
pub type maru_log_fn = Option<
    unsafe extern "C" fn(
        ctx: *mut c_void,
        level: maru_log_level_t,
        target: *const c_char,
        message: *const c_char,
    ),
>;

fn level_filter(raw: LogLevelArg) -> Result<LevelFilter, (maru_status_t, String)> {
    Ok(match raw.0 {
        0 => LevelFilter::Off,
        1 => LevelFilter::Error,
        2 => LevelFilter::Warn,
        3 => LevelFilter::Info,
        4 => LevelFilter::Debug,
        5 => LevelFilter::Trace,
        x => {
            return Err((
                maru_status_t::MARU_ERR_INVALID_ARGUMENT,
                format!("min_level {x} is not a maru_log_level_t (0..=5)"),
            ))
        }
    })
}

fn c_level(l: log::Level) -> maru_log_level_t {
    match l {
        log::Level::Error => maru_log_level_t::MARU_LOG_ERROR,
        log::Level::Warn => maru_log_level_t::MARU_LOG_WARN,
        log::Level::Info => maru_log_level_t::MARU_LOG_INFO,
        log::Level::Debug => maru_log_level_t::MARU_LOG_DEBUG,
        log::Level::Trace => maru_log_level_t::MARU_LOG_TRACE,
    }
}

fn c_text(s: String) -> CString {
    CString::new(s.replace('\0', "\u{FFFD}")).unwrap_or_default()
}

/// Sends libmaru's log messages at `min_level` and more severe to `callback(ctx,
/// level, target, message)` instead of stderr. A NULL `callback` goes back to stderr
/// (`MARU_LOG`).
/// Applies at once, to every handler.
///
/// Threads: `callback` is called from whichever thread logs: the caller's threads inside
/// libmaru calls, and libmaru's own threads (a handler's background thread, its
/// executor threads), possibly several at once; it must not call libmaru. This call
/// may run from any thread; once it returns, no thread is inside the previous callback,
/// so its `ctx` may be freed then.
///
/// Ownership: `callback` and `ctx` must stay valid until replaced by another call.
/// Returns `MARU_ERR_INVALID_ARGUMENT` for an unknown level, `MARU_ERR_BUSY` when the
/// process already has another Rust logger (libmaru linked as a Rust crate).
#[no_mangle]
pub unsafe extern "C" fn maru_set_log_callback(
    min_level: LogLevelArg,
    callback: maru_log_fn,
    ctx: *mut c_void,
) -> maru_status_t {
    ffi_guard(|| {
        let min = level_filter(min_level)?;
        let sink = callback.map(|f| {
            let ctx = ctx as usize;
            Sink {
                min,
                write: Box::new(move |r: &log::Record| {
                    let target = c_text(r.target().to_string());
                    let message = c_text(r.args().to_string());
                    // SAFETY: the runtime's callback with its own context; the strings
                    // live until it returns.
                    unsafe {
                        f(
                            ctx as *mut c_void,
                            c_level(r.level()),
                            target.as_ptr(),
                            message.as_ptr(),
                        )
                    }
                }),
            }
        });
        set_sink(sink).map_err(|e| (maru_status_t::MARU_ERR_BUSY, e))
    })
}

//! `maru_handler_t`: open, shut down, free; stats and chunk size.
//!
//! A handler's memory must outlive every call that uses it, including calls that are
//! blocked when another thread closes it. So the pointer C holds is one reference of
//! an `Arc`, and each call holds its own reference for its duration ([`Call`]): a
//! call in flight never touches freed memory, whatever order the threads run in.
//! The [`Gate`] counts the calls in flight, refuses new ones once shutdown began, and
//! lets shutdown wait (bounded) for those running.

use super::args::req_str;
use super::boundary::{check_not_null, ffi_guard, require_non_null, FfiError};
use super::status::maru_status_t;
use crate::worker::condition::Condition;
use crate::worker::{Handler, HandlerConfig};
use std::ffi::c_char;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// An open handler: the engine's connection to its Maru pools, with its staging slots.
///
/// Create it with `maru_handler_open`; end it with `maru_handler_close` (or
/// `maru_handler_free`, the same), or in two steps with `maru_handler_shutdown` then
/// `maru_handler_free` when other threads may still be calling it.
///
/// Threads: every call on a handler may run from any thread, concurrently with any
/// other call on it, including `maru_handler_shutdown`. A call that begins after
/// shutdown began returns `MARU_ERR_CLOSED` (but for the releases of slots, views and
/// pages, which succeed until `maru_handler_free`); one blocked in
/// `maru_slots_acquire` wakes with `MARU_ERR_CLOSED`. `maru_handler_free` (or `maru_handler_close`) must
/// be the last use of the pointer: calls in flight when it begins are waited for
/// (bounded) and stay memory-safe, but no call may *begin* after it began.
#[allow(non_camel_case_types)]
pub struct maru_handler_t {
    inner: Handler,
    gate: Gate,
    /// How long shutdown waits for calls in flight: the configuration's `timeout_ms`.
    close_wait: Duration,
    /// Held for the whole of a shutdown, so a second one returns only after it ends.
    closing: Mutex<()>,
}

#[derive(Default)]
struct GateState {
    in_flight: usize,
    /// Shutdown began: new calls are refused (releases excepted), blocked ones give up.
    shut: bool,
    /// Shutdown stopped waiting while calls were still in flight: each of them
    /// returns `MARU_ERR_CLOSED` when it leaves (its caller may have freed its
    /// buffers once shutdown returned).
    gave_up: bool,
    /// The handler's sessions are closed (its staging memory may be gone).
    closed: bool,
}

/// The calls in flight on a handler, and its shutdown's wait for them. `idle` is
/// notified when the count drops to zero, which is on every call while nobody waits:
/// a [`Condition`] makes that notify no system call then.
#[derive(Default)]
struct Gate {
    state: Mutex<GateState>,
    idle: Condition,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        // A panic inside a call is caught at the boundary while the gate is not held,
        // so a poisoned lock only means a panic in this file: keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts one call in, or `MARU_ERR_CLOSED` once shutdown began (unless
    /// `after_shutdown`: a release). Returns whether it entered before shutdown began.
    fn enter(&self, after_shutdown: bool) -> Result<bool, FfiError> {
        let mut st = self.lock();
        if st.shut && !after_shutdown {
            return Err(closed_error());
        }
        st.in_flight += 1;
        Ok(!st.shut)
    }

    /// Counts one call out; true when its results are not valid: the handler was
    /// closed under it, or shutdown stopped waiting for it (`before_shut`: it entered
    /// before shutdown began). Decided and uncounted under one lock, so a call either
    /// left before shutdown gave up (and shutdown saw it leave) or is late.
    fn leave(&self, before_shut: bool) -> bool {
        let mut st = self.lock();
        let late = st.closed || (st.gave_up && before_shut);
        st.in_flight -= 1;
        if st.in_flight == 0 {
            self.idle.notify_all();
        }
        late
    }

    /// Refuses new calls and waits up to `wait` for the calls in flight; gives up on
    /// those still running then (they are late when they leave). Idempotent.
    fn shut(&self, wait: Duration) {
        let mut st = self.lock();
        if st.shut {
            return;
        }
        st.shut = true;
        st = self
            .idle
            .wait_timeout_while(st, wait, |s| s.in_flight > 0)
            .unwrap_or_else(|p| p.into_inner())
            .0;
        if st.in_flight > 0 {
            st.gave_up = true;
            log::warn!(
                "maru_handler_shutdown: {} call(s) still running after {} ms (timeout_ms); they will return MARU_ERR_CLOSED: keep the buffers they use until they return",
                st.in_flight,
                wait.as_millis()
            );
        }
    }
}

fn closed_error() -> FfiError {
    (
        maru_status_t::MARU_ERR_CLOSED,
        "the handler is shut down (maru_handler_shutdown or maru_handler_close)".into(),
    )
}

/// One call in flight on a handler: a reference to it and a place in the gate's count.
pub(crate) struct Call {
    h: Arc<maru_handler_t>,
    /// Entered before shutdown began: such a call still running when shutdown stops
    /// waiting is abandoned (it returns `MARU_ERR_CLOSED`). A release entered after
    /// shutdown is never abandoned.
    before_shut: bool,
    /// Still in the gate's count (left by `leave`, or by `drop` on a panic).
    counted: bool,
}

impl Call {
    /// Enters the gate of `h`, or `MARU_ERR_CLOSED` once shutdown began.
    ///
    /// # Safety
    /// `h` is a pointer from `maru_handler_open` whose `maru_handler_free` has not begun.
    unsafe fn enter(h: *const maru_handler_t) -> Result<Call, FfiError> {
        Call::enter_with(h, false)
    }

    /// Enters the gate of `h` also after shutdown began (a release: the handler's
    /// slots, views and pages stay valid until `maru_handler_free`, and giving them
    /// back is always right).
    ///
    /// # Safety
    /// As [`Call::enter`].
    unsafe fn enter_with(h: *const maru_handler_t, after_shutdown: bool) -> Result<Call, FfiError> {
        require_non_null(h, "h")?;
        // The C caller's reference keeps the count above zero until free, and free
        // may not begin before this call did (the documented rule).
        Arc::increment_strong_count(h);
        let h = Arc::from_raw(h);
        let before_shut = h.gate.enter(after_shutdown)?;
        // Counted now: from here on `leave` (or the Call's drop) uncounts it.
        Ok(Call {
            h,
            before_shut,
            counted: true,
        })
    }

    pub(crate) fn handler(&self) -> &Handler {
        &self.h.inner
    }

    /// Whether shutdown began while this call ran (a blocked call gives up then).
    pub(crate) fn shutting_down(&self) -> bool {
        self.h.gate.lock().shut
    }

    /// Leaves the gate with the call's result: `MARU_ERR_CLOSED` instead when it is
    /// late ([`Gate::leave`]: its results may name memory that is gone, or reach the
    /// caller after it went on).
    fn leave<T>(mut self, r: Result<T, FfiError>) -> Result<T, FfiError> {
        self.counted = false;
        if self.h.gate.leave(self.before_shut) {
            return Err((
                maru_status_t::MARU_ERR_CLOSED,
                "the handler was shut down while this call ran (shutdown stopped waiting for it after timeout_ms); its results are not valid".into(),
            ));
        }
        r
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        if !self.counted {
            return;
        }
        // A panic inside the call: its result is dropped anyway.
        self.h.gate.leave(self.before_shut);
    }
}

/// Runs `f` as one call on handler `h` (NULL: `MARU_ERR_NULL_ARGUMENT`): refused once
/// shutdown began, counted while it runs, and turned into `MARU_ERR_CLOSED` when the
/// handler was closed under it or shutdown stopped waiting for it.
///
/// # Safety
/// As [`Call::enter`].
pub(crate) unsafe fn with_handler<T>(
    h: *const maru_handler_t,
    f: impl FnOnce(&Call) -> Result<T, FfiError>,
) -> Result<T, FfiError> {
    let call = Call::enter(h)?;
    let r = f(&call);
    call.leave(r)
}

/// As [`with_handler`], also after `maru_handler_shutdown` (until
/// `maru_handler_free`): for the calls that give back what the caller holds (slots,
/// views, pages), which a runtime makes after every call, also the last ones.
///
/// # Safety
/// As [`Call::enter`].
pub(crate) unsafe fn with_handler_releasing<T>(
    h: *const maru_handler_t,
    f: impl FnOnce(&Call) -> Result<T, FfiError>,
) -> Result<T, FfiError> {
    let call = Call::enter_with(h, true)?;
    let r = f(&call);
    call.leave(r)
}

impl maru_handler_t {
    /// Refuses new calls, wakes blocked ones and waits up to `close_wait` for the calls
    /// in flight. Idempotent; a second caller waits for the first.
    fn shutdown(&self) {
        let _one_at_a_time = self.closing.lock().unwrap_or_else(|p| p.into_inner());
        self.gate.shut(self.close_wait);
    }

    /// Shuts down (if not yet), then closes the sessions: slots, views and the staging
    /// buffer end, the memory hook's `unregister` runs. Idempotent.
    fn close_sessions(&self) -> Result<(), FfiError> {
        self.shutdown();
        let _one_at_a_time = self.closing.lock().unwrap_or_else(|p| p.into_inner());
        let mut st = self.gate.lock();
        if st.closed {
            return Ok(());
        }
        st.closed = true;
        drop(st);
        self.inner.close()?;
        Ok(())
    }
}

fn config_error(e: String) -> FfiError {
    (
        maru_status_t::MARU_ERR_CONFIG,
        format!("configuration error: {e}"),
    )
}

/// A `server_url` entry must be `host:port` (`[v6]:port` too): a malformed address is
/// a configuration error, not a pool that is down.
fn check_host_port(url: &str) -> Result<(), String> {
    let bad = || format!("server_url entry {url:?} is not host:port (such as 10.0.0.3:5555)");
    let (host, port) = url.rsplit_once(':').ok_or_else(bad)?;
    if host.is_empty() || host.contains('/') || port.parse::<u16>().map_or(true, |p| p == 0) {
        return Err(bad());
    }
    Ok(())
}

/// Opens a handler from a JSON configuration (docs/configuration.md): `backend`
/// (`remote_cxl` or `cxl`), `server_url`, `engine_id`, namespace, layout, agent key
/// file, maru-server key file (`server_key_file`, else `MARU_SERVER_KEY_FILE`, else
/// `~/.maru/server.key` when it exists),
/// transport, staging slot counts, `timeout_ms`. On success `*out` is the new
/// handler.
///
/// A configuration error (bad JSON, unknown field, malformed `server_url`) returns
/// `MARU_ERR_CONFIG` at once: do not retry. `MARU_ERR_UNAVAILABLE` means no pool of
/// `server_url` answered; with several pools, the open succeeds when at least one
/// answers and the others are retried in the background. A failing memory hook
/// `register` returns `MARU_ERR_CONFIG`. A failed open leaves nothing open (no
/// session at any maru-server) and logs one line: ERROR for what a person must fix
/// (configuration, key, a refusal), WARN when no maru-server answered.
///
/// Ownership: `config_json` is read during the call only; the handler in `*out` is
/// the caller's until `maru_handler_close` (or `maru_handler_free`).
/// Threads: any thread; handlers are independent of each other. The memory hook and
/// log callback in force when the open starts are the ones it uses.
#[no_mangle]
pub unsafe extern "C" fn maru_handler_open(
    config_json: *const c_char,
    out: *mut *mut maru_handler_t,
) -> maru_status_t {
    crate::logging::install();
    ffi_guard(|| {
        let r = open_handler(config_json, out);
        if let Err((status, why)) = &r {
            log_open_failure(*status, why);
        }
        r
    })
}

/// One line for a failed open: ERROR for what a person must fix (the configuration,
/// a key, a refusal by a daemon), WARN for what may pass (no maru-server answered).
fn log_open_failure(status: maru_status_t, why: &str) {
    match status {
        maru_status_t::MARU_ERR_CONFIG
        | maru_status_t::MARU_ERR_AUTH
        | maru_status_t::MARU_ERR_REFUSED
        | maru_status_t::MARU_ERR_INVALID_ARGUMENT
        | maru_status_t::MARU_ERR_NULL_ARGUMENT => log::error!(
            "maru_handler_open failed ({status:?}): {why}; nothing was opened: fix the configuration and open again"
        ),
        _ => log::warn!(
            "maru_handler_open failed ({status:?}): {why}; nothing was opened: open again when maru-server answers"
        ),
    }
}

/// The body of `maru_handler_open`.
///
/// # Safety
/// As `maru_handler_open`.
unsafe fn open_handler(
    config_json: *const c_char,
    out: *mut *mut maru_handler_t,
) -> Result<(), FfiError> {
    {
        check_not_null!(config_json, out);
        let cfg = req_str(config_json, "config_json")?;
        // Parsed here for the shutdown wait and the address check; Handler::open
        // parses it again.
        let parsed = HandlerConfig::parse(cfg).map_err(config_error)?;
        for url in parsed.server_urls().map_err(config_error)? {
            check_host_port(&url).map_err(config_error)?;
        }
        let close_wait = Duration::from_millis(parsed.timeout_ms);
        let inner = Handler::open(cfg)?;
        let h = Arc::new(maru_handler_t {
            inner,
            gate: Gate::default(),
            close_wait,
            closing: Mutex::new(()),
        });
        *out = Arc::into_raw(h).cast_mut();
        Ok(())
    }
}

/// Writes the handler's statistics as JSON (NUL-terminated) into `buf` of `cap`
/// bytes; `*out_len` is the JSON's length without the NUL. Too small a buffer returns
/// `MARU_ERR_BUFFER_TOO_SMALL` (call again with `*out_len + 1` bytes; `buf` may be
/// NULL with `cap` 0 to ask for the length).
///
/// The JSON holds per-pool counters (`pools`, `total`), the staging slots
/// (`staging`), the calls by kind (`ops`: `store`, `load`, `exists`, `remove`,
/// `store_slots`, `load_slots`, `views`, each with `ok`, `failed`, `items` and a
/// latency histogram `latency_us_le` of `[bound_us, calls]` cumulative pairs and
/// `latency_us_sum`, and the peers the calls asked: `server_round_trips` to
/// maru-server, `agent_contacts` at agents) and the process-wide memory hook (`memory_hook`: `mode`,
/// `pinned_bytes` registered now, `register_failures` so far). `total.skipped` (and each pool's `stats.skipped`) counts
/// the chunks skipped per reason: `no_region` (maru-server had no region to give and
/// nothing of the engine's own could be evicted), `no_slot` (no free staging slot),
/// `pool_unavailable` (the pool's maru-server is away, reconnecting; or the agent of
/// the pages does not answer, probed every 250 ms), `max_bytes`
/// (the engine holds `max_bytes` of regions and nothing of them could be evicted).
/// Each reason also logs one WARN line per 10 s.
///
/// Ownership: `buf` and `out_len` are the caller's. Threads: any, concurrently with
/// other calls.
#[no_mangle]
pub unsafe extern "C" fn maru_stats_json(
    h: *const maru_handler_t,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> maru_status_t {
    ffi_guard(|| {
        with_handler(h, |call| {
            check_not_null!(out_len);
            let mut stats = call.handler().stats();
            if let Some(m) = stats.as_object_mut() {
                m.insert("memory_hook".into(), super::hook::hook_stats_json());
            }
            let s = stats.to_string();
            *out_len = s.len();
            if buf.is_null() || cap < s.len() + 1 {
                return Err((
                    maru_status_t::MARU_ERR_BUFFER_TOO_SMALL,
                    format!("stats need {} bytes", s.len() + 1),
                ));
            }
            std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
            *buf.add(s.len()) = 0;
            Ok(())
        })
    })
}

/// Sets `*out` to the pools' chunk (page) size: the largest chunk a store takes.
/// `MARU_ERR_UNAVAILABLE` while no pool has been reached.
///
/// Threads: any, concurrently with other calls.
#[no_mangle]
pub unsafe extern "C" fn maru_chunk_size(h: *const maru_handler_t, out: *mut u64) -> maru_status_t {
    ffi_guard(|| {
        with_handler(h, |call| {
            check_not_null!(out);
            *out = call.handler().chunk_size().ok_or((
                maru_status_t::MARU_ERR_UNAVAILABLE,
                "no pool has been reached yet".to_string(),
            ))?;
            Ok(())
        })
    })
}

/// The first step of a two-step close, for a handler other threads may still be
/// calling: refuses new calls on `h` (they return `MARU_ERR_CLOSED`; releases of
/// slots, views and pages still succeed), wakes calls blocked in
/// `maru_slots_acquire` (they return `MARU_ERR_CLOSED`), and returns only once every
/// call in flight has left libmaru, so the runtime may free or unregister the
/// buffers those calls used as soon as it returns.
///
/// The wait is bounded by the configuration's `timeout_ms` (10 s by default); every
/// call bounds its own waits by it too, so only a call held by the runtime itself (a
/// memory hook callback that does not return, say) outlives it. Such a call returns
/// `MARU_ERR_CLOSED`, never `MARU_OK`, whenever it ends, and may still write its
/// output arguments until then: keep its buffers until it returned (a warning names
/// how many calls shutdown stopped waiting for).
///
/// Everything stays valid after it: the handler's memory, the slots and views the
/// caller holds (their bytes may still be read, and released), the sessions, and the
/// operations already submitted (they run on; `maru_handler_free` settles them).
/// Once the threads that used the handler are joined, end it with
/// `maru_handler_free`.
///
/// Returns `MARU_OK` (also when called again). Threads: any thread, concurrently with
/// any call on `h` except `maru_handler_free`/`maru_handler_close`; a second call
/// returns once the first finished waiting.
#[no_mangle]
pub unsafe extern "C" fn maru_handler_shutdown(h: *const maru_handler_t) -> maru_status_t {
    ffi_guard(|| {
        check_not_null!(h);
        (*h).shutdown();
        Ok(())
    })
}

/// Ends a handler: shuts it down if `maru_handler_shutdown` was not called (the same
/// bounded wait for calls in flight), settles the operations submitted with
/// `maru_submit_store_slots`/`maru_submit_load_slots` (queued ones run, and each
/// finishes within its own `timeout_ms`; the wait for all of them ends after
/// `timeout_ms`, and one still running then ends with `MARU_ERR_CLOSED`), closes the
/// sessions (the keys it stored stay readable by other engines; its slots, views and
/// staging buffer end; the memory hook's `unregister` runs on this thread), and frees
/// it. NULL is ignored.
///
/// The pointer, and every slot and view of the handler, must not be used afterwards,
/// and no call on `h` may begin once this one began. Calls already in flight are
/// safe: the memory they use lives until the last of them returns. Operations stay
/// valid (free them with `maru_op_free`): their results are final once this returns.
///
/// Returns `MARU_OK`, or the error of closing a session (the handler is freed all the
/// same). Threads: any thread, once per handler.
#[no_mangle]
pub unsafe extern "C" fn maru_handler_free(h: *mut maru_handler_t) -> maru_status_t {
    ffi_guard(|| {
        if h.is_null() {
            return Ok(());
        }
        let r = (*h).close_sessions();
        // The caller's reference; calls in flight hold their own.
        drop(Arc::from_raw(h.cast_const()));
        r
    })
}

/// The same as `maru_handler_free`: shut down (waiting, bounded, for calls in flight),
/// settle the submitted operations (a submitted store's chunks are stored, bounded by
/// `timeout_ms`), close the sessions, free. For a handler that other threads may still
/// call, use `maru_handler_shutdown`, join those threads, then `maru_handler_free`.
///
/// Threads: any thread, once per handler; no call on `h` may begin once it began.
#[no_mangle]
pub unsafe extern "C" fn maru_handler_close(h: *mut maru_handler_t) -> maru_status_t {
    maru_handler_free(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_malformed_server_url_is_a_configuration_error() {
        for bad in [
            "localhost",
            "host:",
            ":5555",
            "host:port",
            "host:0",
            "tcp://h:1",
            "h:70000",
        ] {
            assert!(check_host_port(bad).is_err(), "{bad}");
        }
        for good in ["127.0.0.1:5555", "[::1]:5555", "node-3.example:1"] {
            assert!(check_host_port(good).is_ok(), "{good}");
        }
        let cfg = c"{\"backend\":\"cxl\",\"server_url\":\"nohostport\",\"engine_id\":\"e\"}";
        let mut h = std::ptr::null_mut();
        let st = unsafe { maru_handler_open(cfg.as_ptr(), &mut h) };
        assert_eq!(st, maru_status_t::MARU_ERR_CONFIG);
        assert!(h.is_null());
    }

    /// Shutdown returns once the last call in flight left, woken by that call (its
    /// wait is 10 s), and that call's results stand; seen failing with the wait taken
    /// out of `shut` (it returned before the call left) and with the notify of
    /// `leave` taken out (it waited its 10 s).
    #[test]
    #[allow(clippy::disallowed_methods)] // a test: the calls run on threads, timed
    fn shutdown_waits_for_the_calls_in_flight_and_is_woken_by_the_last() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::time::Instant;
        for round in 0..20 {
            let gate = Gate::default();
            let left = AtomicBool::new(false);
            let (a, b) = (gate.enter(false).unwrap(), gate.enter(false).unwrap());
            assert!(a && b);
            std::thread::scope(|t| {
                for before_shut in [a, b] {
                    let (gate, left) = (&gate, &left);
                    t.spawn(move || {
                        std::thread::sleep(Duration::from_millis(20 + round % 3));
                        left.store(true, Ordering::SeqCst);
                        assert!(
                            !gate.leave(before_shut),
                            "a call that left in time is not late"
                        );
                    });
                }
                let start = Instant::now();
                gate.shut(Duration::from_secs(10));
                let took = start.elapsed();
                assert!(
                    left.load(Ordering::SeqCst),
                    "round {round}: shutdown returned before the calls left"
                );
                assert!(took < Duration::from_secs(5), "round {round}: {took:?}");
                assert_eq!(gate.lock().in_flight, 0, "round {round}");
            });
            assert!(!gate.lock().gave_up);
            assert_eq!(
                gate.enter(false).unwrap_err().0,
                maru_status_t::MARU_ERR_CLOSED
            );
            // A release still enters after shutdown, and is never late.
            assert!(!gate.enter(true).unwrap());
            assert!(!gate.leave(false));
        }
    }

    /// A call still running when shutdown stops waiting is late when it leaves (its
    /// caller may have freed its buffers); seen failing with `gave_up` not set.
    #[test]
    fn a_call_shutdown_gave_up_on_is_late() {
        let gate = Gate::default();
        let before_shut = gate.enter(false).unwrap();
        gate.shut(Duration::from_millis(10));
        assert!(gate.lock().gave_up);
        assert!(gate.leave(before_shut));
        // A second shutdown returns at once.
        gate.shut(Duration::from_secs(10));
    }

    #[test]
    fn calls_on_null_handlers_name_the_argument() {
        let mut n = 0u64;
        let st = unsafe { maru_chunk_size(std::ptr::null(), &mut n) };
        assert_eq!(st, maru_status_t::MARU_ERR_NULL_ARGUMENT);
        assert_eq!(
            unsafe { maru_handler_close(std::ptr::null_mut()) },
            maru_status_t::MARU_OK
        );
        assert_eq!(
            unsafe { maru_handler_shutdown(std::ptr::null()) },
            maru_status_t::MARU_ERR_NULL_ARGUMENT
        );
    }
}

//! libmaru's log through the C API's callback (`maru_set_log_callback`), as a runtime
//! sees it (issue 36): lifecycle lines at INFO, a line per call at DEBUG, a WARN when
//! the agent of the engine's regions goes away (kill -9), an ERROR for a failed open.
//! The callback is process-wide: each test looks only at lines naming its own engine,
//! agent or address.

mod support;

use maru::ffi::{
    maru_handler_close, maru_handler_open, maru_handler_t, maru_log_level_t, maru_set_log_callback,
    maru_status_t, maru_store, LogLevelArg,
};
use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};
use support::Stack;

/// Every line the callback received: (level, target, message).
static LINES: Mutex<Vec<(maru_log_level_t, String, String)>> = Mutex::new(Vec::new());

unsafe extern "C" fn collect(
    _ctx: *mut c_void,
    level: maru_log_level_t,
    target: *const c_char,
    message: *const c_char,
) {
    let t = CStr::from_ptr(target).to_string_lossy().into_owned();
    let m = CStr::from_ptr(message).to_string_lossy().into_owned();
    LINES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((level, t, m));
}

fn install_callback() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let st = unsafe {
            maru_set_log_callback(
                LogLevelArg(maru_log_level_t::MARU_LOG_DEBUG as u32),
                Some(collect),
                std::ptr::null_mut(),
            )
        };
        assert_eq!(st, maru_status_t::MARU_OK);
    });
}

/// The lines at `level` whose message contains every one of `words`.
fn lines(level: maru_log_level_t, words: &[&str]) -> Vec<String> {
    LINES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|(l, _, m)| *l == level && words.iter().all(|w| m.contains(w)))
        .map(|(_, _, m)| m.clone())
        .collect()
}

fn open(cfg: &str) -> Result<*mut maru_handler_t, maru_status_t> {
    let c = CString::new(cfg).unwrap();
    let mut h = std::ptr::null_mut();
    match unsafe { maru_handler_open(c.as_ptr(), &mut h) } {
        maru_status_t::MARU_OK => Ok(h),
        st => Err(st),
    }
}

fn store(h: *mut maru_handler_t, key: &str) -> (maru_status_t, bool) {
    let k = CString::new(key).unwrap();
    let data = vec![0x5Au8; 4096];
    let mut stored = false;
    let st = unsafe {
        maru_store(
            h,
            k.as_ptr(),
            data.as_ptr(),
            data.len(),
            std::ptr::null(),
            &mut stored,
        )
    };
    (st, stored)
}

#[test]
fn killing_the_agent_warns_through_the_log_callback() {
    install_callback();
    let server_args: Vec<String> = ["--region-size", "8M", "--chunk-size", "64K"]
        .iter()
        .map(|a| a.to_string())
        .collect();
    let mut st: Stack = support::stack("logs-agent", "64M", true, &server_args);
    let agent_addr = st.agent.as_ref().unwrap().addr.clone();
    let mut cfg = st.handler_config("remote_cxl", "logs-agent-engine", "default", (4, 8));
    cfg["timeout_ms"] = 2000.into();
    let cfg = cfg.to_string();
    let h = open(&cfg).expect("open");
    assert_eq!(store(h, "logs-agent-0"), (maru_status_t::MARU_OK, true));
    // Lifecycle at INFO: the handler, its pool's session, the region mapped.
    let server = st.server.addr.clone();
    assert!(
        !lines(
            maru_log_level_t::MARU_LOG_INFO,
            &["logs-agent-engine", "opened"]
        )
        .is_empty(),
        "no INFO line for the open"
    );
    assert!(
        !lines(
            maru_log_level_t::MARU_LOG_INFO,
            &[&server, "session", "opened"]
        )
        .is_empty(),
        "no INFO line for the pool's session"
    );
    assert!(
        !lines(
            maru_log_level_t::MARU_LOG_INFO,
            &[&server, "mapped at agent", &agent_addr]
        )
        .is_empty(),
        "no INFO line for the region mapped"
    );
    assert!(
        !lines(maru_log_level_t::MARU_LOG_DEBUG, &["store of 1 chunk(s)"]).is_empty(),
        "no DEBUG line for the store"
    );

    st.agent.take().unwrap().kill9();
    // Stores go on (skipped) while the handler finds the agent gone.
    let t0 = Instant::now();
    let mut i = 1;
    let warned = loop {
        let (status, _) = store(h, &format!("logs-agent-{i}"));
        assert_eq!(
            status,
            maru_status_t::MARU_OK,
            "a store with the agent gone"
        );
        let mut w = lines(maru_log_level_t::MARU_LOG_WARN, &[&agent_addr]);
        w.extend(lines(
            maru_log_level_t::MARU_LOG_WARN,
            &[&server, "not stored"],
        ));
        if !w.is_empty() || t0.elapsed() > Duration::from_secs(20) {
            break w;
        }
        i += 1;
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        !warned.is_empty(),
        "no WARN naming agent {agent_addr} or stores not stored within 20 s of kill -9 ({i} stores); the WARN lines: {:?}",
        LINES.lock().unwrap().iter().rev().take(30).collect::<Vec<_>>()
    );
    eprintln!("WARN after kill -9 of the agent: {}", warned[0]);
    // Once per cause and interval, not a line per store.
    let silent = lines(
        maru_log_level_t::MARU_LOG_WARN,
        &[&agent_addr, "did not answer a probe"],
    );
    assert!(
        silent.len() <= 1 + (t0.elapsed().as_secs() / 10) as usize,
        "{silent:?}"
    );
    assert_eq!(
        unsafe { maru_handler_close(h) },
        maru_status_t::MARU_OK,
        "close with the agent gone"
    );
}

#[test]
fn a_configuration_error_logs_one_error_line() {
    install_callback();
    let cfg = r#"{"backend":"cxl","server_url":"no-port-for-the-log-test","engine_id":"logs-config-engine"}"#;
    assert_eq!(open(cfg).err(), Some(maru_status_t::MARU_ERR_CONFIG));
    let errors = lines(
        maru_log_level_t::MARU_LOG_ERROR,
        &["maru_handler_open failed", "no-port-for-the-log-test"],
    );
    assert_eq!(errors.len(), 1, "{errors:?}");
    // An unknown field: refused with a line naming it too.
    let cfg = r#"{"backend":"cxl","server_url":"127.0.0.1:1","engine_id":"e","no_such_field_for_logs":1}"#;
    assert_eq!(open(cfg).err(), Some(maru_status_t::MARU_ERR_CONFIG));
    let errors = lines(
        maru_log_level_t::MARU_LOG_ERROR,
        &["maru_handler_open failed", "no_such_field_for_logs"],
    );
    assert_eq!(errors.len(), 1, "{errors:?}");
}

//! The handler's JSON configuration (the string an engine passes to maru_open).
#![no_main]

use libfuzzer_sys::fuzz_target;
use maru::worker::config::HandlerConfig;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(c) = HandlerConfig::parse(text) {
            let _ = c.server_urls();
        }
    }
});

//! Key files (the agent key): any text gives a key of at least the minimum length
//! or an error naming the file.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maru::auth::keyfile::parse_key_text;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(k) = parse_key_text(Path::new("agent.key"), &text) {
        assert!(k.bytes().len() >= 16);
        // A key's own file text reads back as the same key.
        let again = parse_key_text(Path::new("agent.key"), &k.to_file_text()).expect("own text");
        assert_eq!(again.bytes(), k.bytes());
    }
});

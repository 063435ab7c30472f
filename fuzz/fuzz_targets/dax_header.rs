//! The device header at the start of a DAX device or fake-DAX file (what a device
//! holds is not trusted: another tool or an older build may have written it).
#![no_main]

use libfuzzer_sys::fuzz_target;
use maru::dax::header::DeviceHeader;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some(h)) = DeviceHeader::decode(data) {
        let _ = h.uuid_string();
        let again = DeviceHeader::decode(&h.encode()).expect("own header");
        assert_eq!(again.map(|x| x.uuid_string()), Some(h.uuid_string()));
    }
});

//! Gives libmaru.so its SONAME, `libmaru.so.0` (the major version of the C ABI, see
//! `MARU_ABI_VERSION`), so programs linked with `-lmaru` record that name and an
//! installed library is found as `libmaru.so.0` (make install adds the links).

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libmaru.so.0");
    println!("cargo:rerun-if-changed=build.rs");
}

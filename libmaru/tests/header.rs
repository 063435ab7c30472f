//! `include/maru.h` is generated from `src/ffi` by cbindgen; this test fails when
//! the committed header differs from what the sources generate.
//!
//! Regenerate the header with `make header`, which runs
//! `MARU_UPDATE_HEADER=1 cargo test -p maru --test header`.

use std::path::{Path, PathBuf};

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn header_path() -> PathBuf {
    manifest_dir().join("..").join("include").join("maru.h")
}

/// Generates the header from `src/ffi/mod.rs` and the modules it declares
/// (cbindgen follows `mod` items), so only the ffi module's items reach the
/// header and no `cargo metadata` run is needed.
fn generate() -> Vec<u8> {
    let config = cbindgen::Config::from_file(manifest_dir().join("cbindgen.toml"))
        .expect("read libmaru/cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(manifest_dir().join("src").join("ffi").join("mod.rs"))
        .generate()
        .expect("cbindgen failed to generate include/maru.h");
    let mut out = Vec::new();
    bindings.write(&mut out);
    out
}

#[test]
fn header_is_up_to_date() {
    let generated = generate();
    let path = header_path();
    if std::env::var_os("MARU_UPDATE_HEADER").is_some_and(|v| v == "1") {
        std::fs::write(&path, &generated)
            .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        return;
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    if committed != generated {
        let first_diff = committed
            .split(|b| *b == b'\n')
            .zip(generated.split(|b| *b == b'\n'))
            .position(|(a, b)| a != b)
            .map_or_else(
                || "one file is a prefix of the other".to_owned(),
                |i| format!("first difference at line {}", i + 1),
            );
        panic!("include/maru.h is stale: run `make header` ({first_diff})");
    }
}

#[test]
fn generation_is_deterministic() {
    assert_eq!(generate(), generate());
}

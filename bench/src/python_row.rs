//! Rows measured by a Python script of bench/python (the adapters' way, the vLLM
//! connector's): run with the Python of `MARU_BENCH_PYTHON` (make bench: the
//! repository's .venv, with numpy), the package from bindings/python and the
//! libmaru.so beside this binary, bounded in time; the script prints one JSON object.

use serde::de::DeserializeOwned;

/// Runs `bench/python/<script> <args>` and parses what it prints; bounded by `secs`
/// (the script's measuring time) plus start-up and warm-up.
pub fn run<T: DeserializeOwned>(script: &str, args: &[String], secs: f64) -> Result<T, String> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or("no repository root")?
        .to_path_buf();
    let py = std::env::var("MARU_BENCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let lib = std::env::current_exe()
        .map_err(|e| e.to_string())?
        .with_file_name("libmaru.so");
    if !lib.exists() {
        return Err(format!(
            "{} not built (cargo build --release -p maru --lib)",
            lib.display()
        ));
    }
    let out = std::env::temp_dir().join(format!(
        "maru-bench-{}-{}.json",
        script.trim_end_matches(".py"),
        std::process::id()
    ));
    let mut child = std::process::Command::new(&py)
        .arg(root.join("bench/python").join(script))
        .args(args)
        .env("PYTHONPATH", root.join("bindings/python"))
        .env("MARU_LIB", &lib)
        .stdout(std::fs::File::create(&out).map_err(|e| e.to_string())?)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("{py}: {e} (MARU_BENCH_PYTHON names a Python with numpy)"))?;
    let deadline =
        std::time::Instant::now() + std::time::Duration::from_secs_f64(secs * 2.0 + 180.0);
    let status = loop {
        if let Some(st) = child.try_wait().map_err(|e| e.to_string())? {
            break st;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{script} did not finish in time"));
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut err);
    }
    let text = std::fs::read_to_string(&out).unwrap_or_default();
    let _ = std::fs::remove_file(&out);
    if !status.success() {
        let tail: String = err
            .chars()
            .rev()
            .take(600)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        return Err(format!("{script}: {status}: {tail}"));
    }
    serde_json::from_str(text.trim()).map_err(|e| format!("{script} printed {text:?}: {e}"))
}

//! The logger of libmaru.so: libmaru's `log` records go to the runtime's callback when
//! it set one (`maru_set_log_callback`), else to stderr filtered by `MARU_LOG` (or
//! `RUST_LOG`; `env_logger` syntax such as `info` or `maru::worker=debug`), warnings
//! and errors only by default.
//!
//! The bridge is installed by the C entry points that start libmaru's work (opening a
//! handler, setting a hook or a callback), never by the crate itself: a Rust program
//! that links the `maru` crate (the daemons) keeps its own logger.

use log::{LevelFilter, Log, Metadata, Record};
use std::sync::OnceLock;
use std::sync::RwLock;

/// Where records go while a callback is set.
pub struct Sink {
    /// The most verbose level passed on.
    pub min: LevelFilter,
    /// Called with each record at `min` or above, from whichever thread logged it.
    pub write: Box<dyn Fn(&Record) + Send + Sync>,
}

/// The process's logger: a callback sink when set, else stderr.
pub struct Bridge {
    stderr: env_logger::Logger,
    sink: RwLock<Option<Sink>>,
}

/// The filter used without a callback: `MARU_LOG`, else `RUST_LOG`, else `warn`.
pub fn env_spec() -> String {
    ["MARU_LOG", "RUST_LOG"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.trim().is_empty()))
        .unwrap_or_else(|| "warn".to_string())
}

impl Bridge {
    /// A bridge whose stderr side follows `spec` (env_logger filter syntax).
    pub fn with_spec(spec: &str) -> Bridge {
        Bridge {
            stderr: env_logger::Builder::new()
                .parse_filters(spec)
                .target(env_logger::Target::Stderr)
                // Unit tests that open handlers install the bridge: let libtest
                // capture its output like the tests' own.
                .is_test(cfg!(test))
                .build(),
            sink: RwLock::new(None),
        }
    }

    /// Replaces the sink (`None`: back to stderr). Once this returns, no thread is
    /// inside the old sink's `write` any more (it held the read lock while writing).
    pub fn set_sink(&self, sink: Option<Sink>) {
        let mut g = self.sink.write().unwrap_or_else(|p| p.into_inner());
        *g = sink;
    }

    /// The most verbose level any record may need now.
    pub fn max_level(&self) -> LevelFilter {
        let g = self.sink.read().unwrap_or_else(|p| p.into_inner());
        match g.as_ref() {
            Some(s) => s.min,
            None => self.stderr.filter(),
        }
    }
}

impl Log for Bridge {
    fn enabled(&self, m: &Metadata) -> bool {
        let g = self.sink.read().unwrap_or_else(|p| p.into_inner());
        match g.as_ref() {
            Some(s) => m.level() <= s.min,
            None => self.stderr.enabled(m),
        }
    }

    fn log(&self, r: &Record) {
        let g = self.sink.read().unwrap_or_else(|p| p.into_inner());
        match g.as_ref() {
            Some(s) if r.level() <= s.min => (s.write)(r),
            Some(_) => {}
            None => self.stderr.log(r),
        }
    }

    fn flush(&self) {
        self.stderr.flush();
    }
}

static BRIDGE: OnceLock<(&'static Bridge, bool)> = OnceLock::new();

/// Installs the bridge as the process's logger (once). Returns it when it is the
/// logger, `None` when another logger was installed first.
pub fn install() -> Option<&'static Bridge> {
    let (b, ours) = *BRIDGE.get_or_init(|| {
        let b: &'static Bridge = Box::leak(Box::new(Bridge::with_spec(&env_spec())));
        let ours = log::set_logger(b).is_ok();
        if ours {
            log::set_max_level(b.max_level());
        }
        (b, ours)
    });
    ours.then_some(b)
}

/// Sends libmaru's records to `sink` (`None`: back to stderr).
pub fn set_sink(sink: Option<Sink>) -> Result<(), String> {
    let b = install().ok_or_else(|| {
        "another logger is installed in this process; libmaru's records go to it".to_string()
    })?;
    b.set_sink(sink);
    log::set_max_level(b.max_level());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    fn record_at(level: log::Level, f: impl FnOnce(&Record)) {
        f(&Record::builder()
            .level(level)
            .target("maru::worker")
            .args(format_args!("staging full"))
            .build())
    }

    #[test]
    fn a_sink_gets_records_at_its_level_and_above_only() {
        let b = Bridge::with_spec("warn");
        let got = Arc::new(Mutex::new(Vec::new()));
        let g = got.clone();
        b.set_sink(Some(Sink {
            min: LevelFilter::Info,
            write: Box::new(move |r| g.lock().unwrap().push((r.level(), r.args().to_string()))),
        }));
        assert_eq!(b.max_level(), LevelFilter::Info);
        record_at(log::Level::Debug, |r| b.log(r));
        record_at(log::Level::Info, |r| b.log(r));
        record_at(log::Level::Error, |r| b.log(r));
        assert_eq!(
            *got.lock().unwrap(),
            vec![
                (log::Level::Info, "staging full".to_string()),
                (log::Level::Error, "staging full".to_string())
            ]
        );
        b.set_sink(None);
        assert_eq!(
            b.max_level(),
            LevelFilter::Warn,
            "back to the stderr filter"
        );
        record_at(log::Level::Error, |r| b.log(r));
        assert_eq!(got.lock().unwrap().len(), 2, "an unset sink gets nothing");
    }

    #[test]
    fn the_stderr_side_follows_its_filter() {
        let b = Bridge::with_spec("warn");
        let m = |l| Metadata::builder().level(l).target("maru::worker").build();
        assert!(b.enabled(&m(log::Level::Warn)));
        assert!(!b.enabled(&m(log::Level::Info)));
        let b = Bridge::with_spec("maru::worker=debug");
        assert!(b.enabled(&m(log::Level::Debug)));
    }
}

//! What Maru's integration tests (`daemons/tests`), its benchmark (`bench`) and its
//! chaos run (`chaos`) share to drive daemons from outside: a daemon started with
//! `--port P --ready-file F` and waited for until it names its address, bounded
//! polling, and a seeded generator for replays that must be the same at every run.
//! Nothing here is shipped; libmaru uses it only in its own tests.

use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How often [`spawn_ready`] looks at the ready file.
const READY_POLL: Duration = Duration::from_millis(20);

/// Why a daemon did not come up.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The program could not be started at all.
    #[error("cannot start: {0}")]
    Spawn(#[source] std::io::Error),
    /// It exited before it wrote its ready file.
    #[error("exited during start-up: {0}")]
    Exited(ExitStatus),
    /// Its ready file did not name an address within the limit; it has been killed.
    #[error("did not become ready within {0:?}")]
    NotReady(Duration),
}

/// Starts the daemon `cmd` (its stdout and stderr as the caller set them, stdin
/// none) with `--port port --ready-file ready` added, and waits up to `within` until
/// the file holds its address (a line the daemon writes once it listens). On
/// [`StartError::NotReady`] the process has been killed and reaped.
pub fn spawn_ready(
    cmd: &mut Command,
    ready: &Path,
    port: u16,
    within: Duration,
) -> Result<(Child, String), StartError> {
    let _ = std::fs::remove_file(ready);
    cmd.arg("--port")
        .arg(port.to_string())
        .arg("--ready-file")
        .arg(ready)
        .stdin(Stdio::null());
    let mut child = cmd.spawn().map_err(StartError::Spawn)?;
    let deadline = Instant::now() + within;
    loop {
        if let Ok(s) = std::fs::read_to_string(ready) {
            if s.ends_with('\n') {
                return Ok((child, s.trim().to_string()));
            }
        }
        if let Ok(Some(st)) = child.try_wait() {
            return Err(StartError::Exited(st));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(StartError::NotReady(within));
        }
        std::thread::sleep(READY_POLL);
    }
}

/// The port of `host:port` (0 when there is none).
pub fn port_of(addr: &str) -> u16 {
    addr.rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or(0)
}

/// Calls `f` every `every` until it is true, for at most `limit`; then once more.
pub fn wait_until(limit: Duration, every: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(every);
    }
    f()
}

/// A fixed, seeded stream (xorshift64*): a replay built from it is the same at every
/// run, and a test that fails can be run again with its seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_daemon_is_ready_once_its_file_names_a_line_and_not_before() {
        let dir = std::env::temp_dir().join(format!("maru-testkit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ready = dir.join("ready");
        // A "daemon" that writes half a line, then the whole one: the address is read
        // only once the line ends.
        let script = "f=\"$4\"; printf 127.0.0.1 > \"$f\"; sleep 0.2; printf '127.0.0.1:%s\\n' \"$2\" > \"$f\"; sleep 5";
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(script).arg("sh");
        let t = Instant::now();
        let (mut child, addr) =
            spawn_ready(&mut cmd, &ready, 4242, Duration::from_secs(5)).unwrap();
        assert_eq!(addr, "127.0.0.1:4242");
        assert_eq!(port_of(&addr), 4242);
        assert!(
            t.elapsed() >= Duration::from_millis(200),
            "{:?}",
            t.elapsed()
        );
        let _ = child.kill();
        let _ = child.wait();
        let mut quits = Command::new("sh");
        quits.arg("-c").arg("exit 3");
        let e = spawn_ready(&mut quits, &ready, 0, Duration::from_secs(5)).unwrap_err();
        assert!(
            matches!(e, StartError::Exited(st) if st.code() == Some(3)),
            "{e}"
        );
        let mut silent = Command::new("sh");
        silent.arg("-c").arg("sleep 5").arg("sh");
        let t = Instant::now();
        let e = spawn_ready(&mut silent, &ready, 0, Duration::from_millis(100)).unwrap_err();
        assert!(matches!(e, StartError::NotReady(_)), "{e}");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_stream_is_the_same_for_a_seed() {
        let mut a = Rng(7);
        let mut b = Rng(7);
        let xs: Vec<u64> = (0..4).map(|_| a.next_u64()).collect();
        assert_eq!(xs, (0..4).map(|_| b.next_u64()).collect::<Vec<_>>());
        assert!(xs.windows(2).all(|w| w[0] != w[1]));
        assert!((0..1000).all(|_| (0.0..1.0).contains(&a.unit())));
    }
}

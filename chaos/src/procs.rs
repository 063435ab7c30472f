//! Processes of the chaos run: daemons started on a given port (0 first, then the
//! port they got, so clients find them again after a restart), engines, and a scratch
//! directory; everything is killed and removed on drop, also when the run fails.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Scratch {
    pub dir: PathBuf,
    shm: Vec<PathBuf>,
    keep: bool,
}

impl Scratch {
    pub fn new(tag: &str) -> Result<Scratch, String> {
        let dir = std::env::temp_dir().join(format!("maru-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        Ok(Scratch {
            dir,
            shm: Vec::new(),
            keep: std::env::var_os("CHAOS_KEEP").is_some(),
        })
    }

    /// Keep the directory (the logs of every process) when the run ends; the fake-DAX
    /// file still goes.
    pub fn keep(&mut self) {
        self.keep = true;
    }

    /// A fake-DAX file path, in /dev/shm when there is one.
    pub fn shm_file(&mut self, name: &str) -> PathBuf {
        let base = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            self.dir.clone()
        };
        let p = base.join(format!("maru-chaos-{name}-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        self.shm.push(p.clone());
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if self.keep {
            eprintln!("chaos: logs kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
        for p in &self.shm {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A child process, killed (SIGKILL) and reaped on drop.
pub struct Proc {
    child: Option<Child>,
    pub port: u16,
    pub log: PathBuf,
}

impl Proc {
    pub fn none() -> Proc {
        Proc {
            child: None,
            port: 0,
            log: PathBuf::new(),
        }
    }

    pub fn spawn(bin: &str, args: &[String], log: &Path) -> Result<Proc, String> {
        let child = logged(bin, args, log)?
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {bin}: {e}"))?;
        Ok(Proc {
            child: Some(child),
            port: 0,
            log: log.to_path_buf(),
        })
    }

    /// Starts daemon `bin` on `port` (0: a free one) and waits (≤ 20 s) for its ready
    /// file. A port just given up by a killed process may take a moment to bind again,
    /// so a start that fails is tried again (≤ 10 times).
    pub fn daemon_at(bin: &str, args: &[String], s: &Scratch, port: u16) -> Result<Proc, String> {
        let name = Path::new(bin)
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        let ready = s.dir.join(format!("{name}.ready"));
        let log = s.dir.join(format!("{name}.log"));
        let mut last = String::new();
        for _ in 0..10 {
            let mut cmd = logged(bin, args, &log)?;
            match maru_testkit::spawn_ready(&mut cmd, &ready, port, Duration::from_secs(20)) {
                Ok((child, addr)) => {
                    return Ok(Proc {
                        child: Some(child),
                        port: maru_testkit::port_of(&addr),
                        log,
                    })
                }
                Err(e @ maru_testkit::StartError::Spawn(_)) => return Err(format!("{bin}: {e}")),
                Err(e) => last = format!("{name} {e} (log {})", log.display()),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Err(last)
    }

    pub fn is_running(&mut self) -> bool {
        match &mut self.child {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// kill -9 and reap.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits for the process to exit by itself; kills it after `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(c) = &mut self.child {
                if let Ok(Some(st)) = c.try_wait() {
                    self.child = None;
                    return st.code();
                }
            } else {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill9();
        None
    }

    /// SIGTERM, then wait (≤ `limit`) for the exit code.
    pub fn terminate(&mut self, limit: Duration) -> Option<i32> {
        if let Some(c) = &self.child {
            // SAFETY: kill(2) on our own child's pid.
            unsafe {
                libc::kill(c.id() as i32, libc::SIGTERM);
            }
        }
        self.wait_exit(limit)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// `bin args`, its stdout and stderr appended to `log`.
fn logged(bin: &str, args: &[String], log: &Path) -> Result<Command, String> {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| format!("{}: {e}", log.display()))?;
    let err = out
        .try_clone()
        .map_err(|e| format!("{}: {e}", log.display()))?;
    let mut cmd = Command::new(bin);
    cmd.args(args).stdout(out).stderr(err);
    Ok(cmd)
}

/// Polls `f` every 50 ms until it is true, for at most `limit`.
pub fn wait_until(limit: Duration, f: impl FnMut() -> bool) -> bool {
    maru_testkit::wait_until(limit, Duration::from_millis(50), f)
}

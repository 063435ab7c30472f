//! Processes the benchmark starts on loopback: the Maru daemons (resource manager on a
//! fake DAX file, remote CXL agent, maru-server) and redis-server. Every wait is
//! bounded; every child is killed when its guard drops, also on error.
//!
//! The fake DAX file lies on a tmpfs with 2 MiB pages that the benchmark mounts for
//! itself (a private mount namespace: nothing else sees it, and it goes with the
//! process), because a devdax device maps its memory with 2 MiB pages: a first store
//! into a region then takes one page fault per 2 MiB, not 512. Where that mount is
//! not allowed, the pool lies in /dev/shm with 4 KiB pages, and the report says so.

use maru::auth::{keyfile::write_new_key_file, SharedKey};
use std::net::TcpListener;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A child process, stopped (SIGTERM, then SIGKILL after 3 s) when dropped.
pub struct Proc {
    child: Child,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        stop(&mut self.child);
    }
}

/// Stops a child of ours: SIGTERM, then SIGKILL if it has not exited within 3 s; reaped
/// either way.
pub fn stop(child: &mut Child) {
    // SAFETY: kill(2) on the pid of our own child, which we have not reaped yet.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A command whose process is killed when the benchmark dies (a signal, say) before
/// its guard could stop it. The benchmark starts its children from the main thread,
/// which lives as long as the process.
pub fn with_parent(mut cmd: Command) -> Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl(2) is async-signal-safe and touches only the child being made.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// The directory of the running binary (the daemons are built beside it).
pub fn bin_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.to_path_buf()))
        .unwrap_or_default()
}

/// Starts a Maru daemon with `--port 0 --ready-file F` and waits (≤ 20 s) for its address.
pub fn start_daemon(bin: &Path, args: &[String], ready: &Path) -> Result<(Proc, String), String> {
    start_daemon_within(bin, args, ready, Duration::from_secs(20))
}

/// Starts a resource manager with its state (and the key it makes, `rm.key`) in
/// `state`, on a fake-DAX pool `pool` of `size` (bytes, or the RM's `64M` syntax);
/// `ready` is its readiness file. Returns it, its address and its key file.
pub fn start_rm(
    state: &Path,
    pool: &Path,
    size: impl std::fmt::Display,
    ready: &Path,
) -> Result<(Proc, String, String), String> {
    let args = [
        "--state-dir".into(),
        state.display().to_string(),
        "--fake-dax".into(),
        format!("{}:{size}", pool.display()),
    ];
    let (rm, addr) = start_daemon(&bin_dir().join("maru-resource-manager"), &args, ready)?;
    Ok((rm, addr, state.join("rm.key").display().to_string()))
}

/// Starts a remote-cxl agent of node `node` on device `pool` for the RM at `rm_addr`
/// (whose key file is `rm_key`), with its own key file `key_file` and `extra` after
/// those arguments; `ready` is its readiness file.
pub fn start_agent(
    rm_addr: &str,
    rm_key: &str,
    key_file: &Path,
    pool: &Path,
    node: &str,
    extra: &[String],
    ready: &Path,
) -> Result<(Proc, String), String> {
    let mut args = vec![
        "--rm-address".into(),
        rm_addr.to_string(),
        "--rm-key-file".into(),
        rm_key.to_string(),
        "--key-file".into(),
        key_file.display().to_string(),
        "--device".into(),
        pool.display().to_string(),
        "--node".into(),
        node.to_string(),
    ];
    args.extend_from_slice(extra);
    start_daemon(&bin_dir().join("maru-remote-cxl-agent"), &args, ready)
}

/// [`start_daemon`] that waits up to `within` for the ready file.
pub fn start_daemon_within(
    bin: &Path,
    args: &[String],
    ready: &Path,
    within: Duration,
) -> Result<(Proc, String), String> {
    if !bin.is_file() {
        return Err(format!(
            "{} not found: build the daemons first (cargo build --release -p maru-daemons --bins)",
            bin.display()
        ));
    }
    let mut cmd = with_parent(Command::new(bin));
    cmd.args(args)
        .arg("--log-level")
        .arg("warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let (child, addr) = maru_testkit::spawn_ready(&mut cmd, ready, 0, within)
        .map_err(|e| format!("{}: {e}", bin.display()))?;
    Ok((Proc { child }, addr))
}

/// A tmpfs with 2 MiB pages (`huge=always`) in a mount namespace of this process's own.
/// Unmounted and its directory removed on drop.
pub struct HugeTmpfs {
    pub dir: PathBuf,
}

impl HugeTmpfs {
    /// Enters a private mount namespace and mounts the tmpfs there (`size` bytes at
    /// most). Call it before the process starts any thread: only the calling thread
    /// and what it starts afterwards enter the namespace. Needs CAP_SYS_ADMIN.
    pub fn mount(size: u64) -> Result<HugeTmpfs, String> {
        let os = |what: &str| format!("{what}: {}", std::io::Error::last_os_error());
        // SAFETY: unshare(2) and mount(2) with valid, NUL-terminated arguments; they
        // change only this process's view of the mounts.
        unsafe {
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                return Err(os("unshare(CLONE_NEWNS)"));
            }
            // Mounts made here must not propagate back to the host's namespace.
            let root = c"/";
            if libc::mount(
                std::ptr::null(),
                root.as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) != 0
            {
                return Err(os("making / private"));
            }
        }
        let dir = std::env::temp_dir().join(format!("maru-bench-huge-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let target = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
            .map_err(|e| e.to_string())?;
        let data = std::ffi::CString::new(format!("huge=always,size={size},mode=0700"))
            .map_err(|e| e.to_string())?;
        let src = c"maru-bench";
        let fstype = c"tmpfs";
        // SAFETY: as above.
        let r = unsafe {
            libc::mount(
                src.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                0,
                data.as_ptr().cast(),
            )
        };
        if r != 0 {
            let e = os(&format!("mounting a huge-page tmpfs at {}", dir.display()));
            let _ = std::fs::remove_dir(&dir);
            return Err(e);
        }
        Ok(HugeTmpfs { dir })
    }
}

impl Drop for HugeTmpfs {
    fn drop(&mut self) {
        if let Ok(target) = std::ffi::CString::new(self.dir.as_os_str().as_encoded_bytes()) {
            // SAFETY: umount2(2) on the path we mounted.
            unsafe {
                libc::umount2(target.as_ptr(), libc::MNT_DETACH);
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// A directory of the bench's own under the temp dir, made empty when it is made and
/// removed with what it holds when dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    /// `maru-bench-{name}-{pid}` under the temp dir.
    pub fn fresh(name: &str) -> Result<TempDir, String> {
        let dir = std::env::temp_dir().join(format!("maru-bench-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        Ok(TempDir(dir))
    }
}

impl std::ops::Deref for TempDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A scratch directory and the shared fake-DAX pool file, removed on drop.
pub struct Scratch {
    pub dir: TempDir,
    pub pool: PathBuf,
    pub pool_size: u64,
    pub key_file: PathBuf,
    /// maru-server's key (made at its first start), which the handlers prove.
    pub server_key: PathBuf,
    /// Bytes of the pool the kernel gave 2 MiB pages (`ShmemHugePages` grew by them
    /// when the pool was allocated), where it could be told.
    pub huge_bytes: Option<u64>,
}

impl Scratch {
    /// A scratch directory whose pool file (`pool_size` bytes) lies in `pool_dir`, or
    /// in /dev/shm when that is None.
    fn new(tag: &str, pool_size: u64, pool_dir: Option<&Path>) -> Result<Scratch, String> {
        let pid = std::process::id();
        let dir = TempDir::fresh(tag)?;
        let shm = match pool_dir {
            Some(d) => d.to_path_buf(),
            None if Path::new("/dev/shm").is_dir() => PathBuf::from("/dev/shm"),
            None => dir.to_path_buf(),
        };
        let pool = shm.join(format!("maru-bench-pool-{pid}-{tag}"));
        let _ = std::fs::remove_file(&pool);
        let key_file = dir.join("agent.key");
        let key = SharedKey::generate().map_err(|e| format!("agent key: {e}"))?;
        write_new_key_file(&key_file, &key).map_err(|e| format!("agent key file: {e}"))?;
        let server_key = dir.join("server.key");
        Ok(Scratch {
            server_key,
            dir,
            pool,
            pool_size,
            key_file,
            huge_bytes: None,
        })
    }

    /// As `new`, with the pool created (by a first RM) and every page of it allocated
    /// and touched (`prefault_pool`).
    pub fn with_pool(
        tag: &str,
        pool_size: u64,
        pool_dir: Option<&Path>,
    ) -> Result<Scratch, String> {
        let mut s = Scratch::new(tag, pool_size, pool_dir)?;
        if pool_dir.is_some() {
            compact_memory();
        }
        // Before the first RM: its device header takes the pool's first page.
        let before = shmem_huge_bytes();
        {
            let _st = stack(&s, false, "256M", "2M")?;
        }
        s.prefault_pool()?;
        s.huge_bytes = before
            .zip(shmem_huge_bytes())
            .map(|(b, a)| a.saturating_sub(b).min(pool_size));
        Ok(s)
    }

    /// A fresh path inside the scratch directory.
    pub fn path(&self, tag: &str) -> PathBuf {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        self.dir.join(format!("{tag}-{n}"))
    }

    /// Allocates every page of the pool file now and touches it once, so that stores
    /// measure copies into memory, not tmpfs allocating pages. `fallocate` alone is not
    /// enough: tmpfs zeroes a fallocated page only when it is first mapped, and on a VM
    /// that first touch is also when the host backs the guest page (measured here: 0.3
    /// to 3 GB/s for a first copy into fallocated pages, 3 GB/s into touched ones, whose
    /// remaining cost is the 4 KiB page faults of each new mapping, the worker's to
    /// avoid). Populating writes no byte, and `burn_in` writes back what it reads: the
    /// RM's device header stays.
    fn prefault_pool(&self) -> Result<(), String> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.pool)
            .map_err(|e| format!("{}: {e}", self.pool.display()))?;
        // SAFETY: fallocate(2) on a file descriptor we own, mode 0, within its size.
        let r = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, self.pool_size as libc::off_t) };
        if r != 0 {
            return Err(format!(
                "fallocate {}: {} (is its tmpfs large enough?)",
                self.pool.display(),
                std::io::Error::last_os_error()
            ));
        }
        drop(f);
        let path = self.pool.display().to_string();
        let m = maru::dax::map_range(
            &path,
            maru::dax::DeviceKind::File,
            0,
            self.pool_size,
            maru::dax::DEFAULT_ALIGN,
            true,
        )
        .map_err(|e| format!("mapping the pool to touch it: {e}"))?;
        match m.populate_range(0, m.len()) {
            Ok(true) => {}
            Ok(false) => {
                eprintln!("maru-bench: this kernel cannot populate the pool (MADV_POPULATE_WRITE): the first stores pay for zeroing its pages");
            }
            Err(e) => return Err(format!("touching the pool: {e}")),
        }
        burn_in(&m);
        Ok(())
    }
}

/// Asks the kernel to drop clean page cache and compact free memory (root only; best
/// effort), so that a pool on a `huge=always` tmpfs gets 2 MiB pages throughout: the
/// kernel falls back to 4 KiB pages where it finds no free 2 MiB block, and the figures
/// before the pool (the limits, the raw transport) free gigabytes in pieces. Compaction
/// alone is not enough on a machine whose memory is mostly page cache (a build machine
/// after a day of builds): an idle run on 2026-12-06 got 23.7 % of the pool on 2 MiB pages
/// with 17 GiB cached and 5 GiB free; after dropping the cache, 19 GiB were free. Only
/// clean pages are dropped (the kernel writes nothing back for this); they are read
/// again from disk when used.
fn compact_memory() {
    if let Err(e) = std::fs::write("/proc/sys/vm/drop_caches", "1") {
        eprintln!("maru-bench: could not drop the page cache before allocating the pool ({e})");
    }
    if let Err(e) = std::fs::write("/proc/sys/vm/compact_memory", "1") {
        eprintln!("maru-bench: could not compact memory before allocating the pool ({e})");
    }
}

/// `ShmemHugePages` of /proc/meminfo, in bytes.
fn shmem_huge_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("ShmemHugePages:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}

/// Writes every byte of the pool once more with what it holds, by streaming stores
/// (not timed), so that the figures meet memory as a devdax device's is: backed and
/// written before. On this VM the first full write of each page after populating runs
/// at about 16 GB/s and every later one at 27–30 (a C probe: populate 4 GiB on a
/// `huge=always` tmpfs, then streaming-copy 64 MiB pieces over it pass after pass;
/// one untimed write pass first and the first timed pass runs at 28.6). That is the
/// host backing guest memory, not a cost a device has; without this, the store figure
/// that first writes a part of the pool (cxl batch store, 2 MiB chunks) moved from 12
/// to 23 GB/s between runs. The bytes stay: the RM's device header is kept.
fn burn_in(m: &maru::dax::Mapping) {
    const PIECE: usize = 64 << 20;
    let mut buf = vec![0u8; PIECE.min(m.len())];
    let mut off = 0;
    while off < m.len() {
        let n = PIECE.min(m.len() - off);
        // SAFETY: [off, off + n) lies inside the mapping, which this process alone
        // uses now (no RM or handler runs on the pool yet); `buf` is a separate
        // allocation of at least n bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(m.as_ptr().add(off), buf.as_mut_ptr(), n);
            maru::dax::copy::copy_to_shared(m.as_ptr().add(off), &buf[..n]);
        }
        off += n;
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.pool);
    }
}

/// RM + (agent) + maru-server on loopback over the scratch pool, fresh RM state.
pub struct Stack {
    pub server: String,
    /// The RM's address and the key file that proves to it, for more maru-servers.
    pub rm_addr: String,
    pub rm_key: String,
    pub rm: Proc,
    pub agent: Option<Proc>,
    pub srv: Proc,
}

/// An RM on the scratch pool, an agent when `remote`, and a maru-server keeping its
/// directory durable in a state directory of its own (as a deployed one does).
pub fn stack(
    s: &Scratch,
    remote: bool,
    region_size: &str,
    chunk_size: &str,
) -> Result<Stack, String> {
    stack_with(s, remote, region_size, chunk_size, true)
}

/// [`stack`] whose maru-server keeps its directory durable or (`durable` false) in
/// memory only.
pub fn stack_with(
    s: &Scratch,
    remote: bool,
    region_size: &str,
    chunk_size: &str,
    durable: bool,
) -> Result<Stack, String> {
    // One state directory: `Scratch::path` hands out a new path at each call.
    let (rm, rm_addr, rm_key) = start_rm(
        &s.path("rm-state"),
        &s.pool,
        s.pool_size,
        &s.path("rm.ready"),
    )?;
    let agent = if remote {
        Some(start_agent(
            &rm_addr,
            &rm_key,
            &s.key_file,
            &s.pool,
            "bench-mem0",
            &[],
            &s.path("agent.ready"),
        )?)
    } else {
        None
    };
    let agent_addr = agent.as_ref().map(|(_, a)| a.as_str());
    let state = s.path("server-state");
    let args = server_args(
        s,
        &rm_addr,
        &rm_key,
        agent_addr,
        region_size,
        chunk_size,
        durable.then_some(state.as_path()),
    );
    let (srv, server) = start_server(s, &args)?;
    Ok(Stack {
        server,
        rm_addr,
        rm_key,
        rm,
        agent: agent.map(|(p, _)| p),
        srv,
    })
}

/// The arguments of a maru-server on the RM at `rm_addr` (and the agent at `agent`,
/// if any) keeping its directory in `state` (None: in memory only).
pub fn server_args(
    s: &Scratch,
    rm_addr: &str,
    rm_key: &str,
    agent: Option<&str>,
    region_size: &str,
    chunk_size: &str,
    state: Option<&Path>,
) -> Vec<String> {
    let mut args = vec![
        "--rm-address".to_string(),
        rm_addr.into(),
        "--rm-key-file".into(),
        rm_key.into(),
        "--region-size".into(),
        region_size.into(),
        "--chunk-size".into(),
        chunk_size.into(),
        "--max-sessions".into(),
        "1024".into(),
        "--key-file".into(),
        s.server_key.display().to_string(),
    ];
    match state {
        Some(dir) => args.extend(["--state-dir".into(), dir.display().to_string()]),
        None => args.push("--in-memory".into()),
    }
    if let Some(a) = agent {
        args.extend([
            "--remote-cxl-agent".into(),
            a.into(),
            "--remote-cxl-agent-key-file".into(),
            s.key_file.display().to_string(),
        ]);
    }
    args
}

/// A maru-server with `args` (see [`server_args`]); its process and address.
pub fn start_server(s: &Scratch, args: &[String]) -> Result<(Proc, String), String> {
    start_daemon(
        &bin_dir().join("maru-server"),
        args,
        &s.path("server.ready"),
    )
}

/// A free loopback port (bound, then released for the child to take).
pub fn free_port() -> Result<u16, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("local_addr: {e}"))
}

/// redis-server on loopback, no persistence; waits (≤ 10 s) until it answers PING.
pub fn start_redis() -> Result<(Proc, String), String> {
    let port = free_port()?;
    let child = with_parent(Command::new("redis-server"))
        .args([
            "--save",
            "",
            "--appendonly",
            "no",
            "--bind",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                "redis-server not found: run scripts/install-deps.sh (Debian package redis-server)"
                    .to_string()
            }
            _ => format!("cannot start redis-server: {e}"),
        })?;
    let mut p = Proc { child };
    let addr = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(mut c) = crate::redis::Resp::connect(&addr) {
            if c.ping().is_ok() {
                return Ok((p, addr));
            }
        }
        if let Ok(Some(st)) = p.child.try_wait() {
            return Err(format!("redis-server exited during start-up: {st}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err("redis-server did not answer PING within 10 s".into())
}

#[cfg(test)]
mod tests {
    use super::TempDir;

    /// A temp dir starts empty (a leftover of an earlier run is cleared) and goes with
    /// its files when dropped.
    #[test]
    fn a_temp_dir_starts_empty_and_goes_with_its_files() {
        let d = TempDir::fresh("temp-dir-test").unwrap();
        std::fs::write(d.join("left"), b"x").unwrap();
        let path = d.to_path_buf();
        std::mem::forget(d);
        let d = TempDir::fresh("temp-dir-test").unwrap();
        assert_eq!(
            std::fs::read_dir(&*d).unwrap().count(),
            0,
            "the leftover is gone"
        );
        std::fs::write(d.join("f"), b"x").unwrap();
        drop(d);
        assert!(!path.exists());
    }
}

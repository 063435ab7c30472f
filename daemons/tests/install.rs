//! scripts/install.sh into a scratch root as a packager runs it (DESTDIR): binaries,
//! units, env files written once, the standalone form; no key in the staging root (the
//! daemons make theirs on the host at first start); stripped programs and library with
//! their debug files apart (.gnu_debuglink); LIBDIR in the paths and in maru.pc. And
//! the agent's side of keys made at first start (--create-key, as its unit runs it).

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use support::{Daemon, Scratch, AGENT_BIN, RM_BIN};

fn bin_dir() -> &'static Path {
    Path::new(RM_BIN).parent().unwrap()
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/install.sh")
}

fn install(root: &Path, standalone: bool) -> String {
    install_with(root, if standalone { &["--standalone"] } else { &[] })
}

/// scripts/install.sh `flags` --root `root`, as it ran.
fn run_script(root: &Path, flags: &[&str]) -> std::process::Output {
    Command::new("bash")
        .arg(script())
        .args(flags)
        .arg("--root")
        .arg(root)
        .output()
        .unwrap()
}

fn install_with(root: &Path, flags: &[&str]) -> String {
    let bin = bin_dir().to_str().unwrap();
    let out = run_script(root, &[&["--bin-dir", bin], flags].concat());
    assert!(
        out.status.success(),
        "install.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Every file (not directory) under `dir`, symlinks included.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_symlink() || !p.is_dir() {
                out.push(p);
            } else {
                todo.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The section names of an ELF file, by readelf (binutils, which the build needs).
fn sections(file: &Path) -> String {
    let out = Command::new("readelf")
        .arg("-SW")
        .arg(file)
        .output()
        .expect("readelf (binutils)");
    assert!(out.status.success(), "readelf -S {}", file.display());
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The file name a stripped file's .gnu_debuglink names (the name, then the CRC).
fn debuglink(file: &Path) -> Option<String> {
    let out = Command::new("objcopy")
        .arg("--dump-section")
        .arg(format!(".gnu_debuglink={}.link", file.display()))
        .arg(file)
        .arg(format!("{}.ignored", file.display()))
        .output()
        .expect("objcopy (binutils)");
    let link = PathBuf::from(format!("{}.link", file.display()));
    let _ = std::fs::remove_file(format!("{}.ignored", file.display()));
    if !out.status.success() {
        return None;
    }
    let bytes = std::fs::read(&link).ok()?;
    let _ = std::fs::remove_file(&link);
    let name = bytes.split(|b| *b == 0).next()?;
    Some(String::from_utf8_lossy(name).into_owned())
}

#[test]
fn installs_units_and_env_once() {
    let s = Scratch::new("install");
    let root = s.dir.join("root");
    install(&root, false);
    for b in [
        "maru-resource-manager",
        "maru-rm-ctl",
        "maru-remote-cxl-agent",
        "maru-rdma-check",
    ] {
        assert!(root.join("usr/local/bin").join(b).is_file(), "{b}");
    }
    let unit =
        std::fs::read_to_string(root.join("etc/systemd/system/maru-remote-cxl-agent.service"))
            .unwrap();
    assert!(unit.contains("BindsTo=maru-resource-manager.service"));
    assert!(unit.contains("StartLimitBurst=5"));
    assert!(unit.contains("User=maru"));
    // The agent beside the RM makes the pool's agent key on its first start.
    assert!(
        unit.contains(
            "ExecStart=/usr/local/bin/maru-remote-cxl-agent --create-key $MARU_AGENT_ARGS"
        ),
        "{unit}"
    );
    assert!(unit.contains("StateDirectory=maru"), "{unit}");

    // Edits to env files survive a reinstall.
    let env = root.join("etc/maru/remote-cxl-agent.env");
    std::fs::write(&env, "MARU_RM_ADDRESS=10.0.0.2:9850\n").unwrap();
    let out = install(&root, true);
    assert!(out.contains("kept"));
    assert_eq!(
        std::fs::read_to_string(&env).unwrap(),
        "MARU_RM_ADDRESS=10.0.0.2:9850\n"
    );
    // The standalone form is wanted by multi-user.target, not bound to the RM, and uses
    // a copy of the pool's agent key: it makes none.
    let unit =
        std::fs::read_to_string(root.join("etc/systemd/system/maru-remote-cxl-agent.service"))
            .unwrap();
    assert!(unit.contains("WantedBy=multi-user.target"));
    assert!(!unit.contains("BindsTo="));
    assert!(!unit.contains("--create-key"), "{unit}");
}

#[test]
fn a_fresh_standalone_install_leaves_the_rm_address_to_fill_in() {
    let s = Scratch::new("install-sa");
    let root = s.dir.join("root");
    let out = install(&root, true);
    let env = std::fs::read_to_string(root.join("etc/maru/remote-cxl-agent.env")).unwrap();
    assert!(env.lines().any(|l| l == "MARU_RM_ADDRESS="), "{env}");
    assert!(out.contains("copy the pool's agent key"), "{out}");
}

/// A package built with DESTDIR ships to every host: it must hold no secret key. Each
/// env file names a key under /var/lib/maru, which the daemons make on the host.
#[test]
fn a_destdir_install_holds_no_key() {
    let s = Scratch::new("install-nokey");
    for flags in [&[][..], &["--standalone"], &["--metadata"], &["--worker"]] {
        let root = s.dir.join(format!("root{}", flags.join("")));
        install_with(&root, flags);
        let files = files_under(&root);
        let keys: Vec<_> = files
            .iter()
            .filter(|p| {
                p.extension().is_some_and(|x| x == "key")
                    || std::fs::read_to_string(p).is_ok_and(|t| t.contains("maru shared key"))
            })
            .collect();
        assert!(
            keys.is_empty(),
            "{flags:?}: keys in the staging root: {keys:?}"
        );
        assert!(
            !root.join("var").exists(),
            "{flags:?}: a state directory was staged"
        );
        for env in files
            .iter()
            .filter(|p| p.extension().is_some_and(|x| x == "env"))
        {
            let text = std::fs::read_to_string(env).unwrap();
            for line in text.lines().filter(|l| l.contains("KEY_FILE=")) {
                assert!(
                    line.contains("=/var/lib/maru/"),
                    "{}: {line} (keys are made at first start in /var/lib/maru)",
                    env.display()
                );
            }
        }
    }
}

#[test]
fn installed_programs_and_library_are_stripped_with_their_debug_info_apart() {
    let s = Scratch::new("install-strip");
    let root = s.dir.join("root");
    install(&root, false);
    install_with(&root, &["--metadata"]);
    let prefix = root.join("usr/local");
    let mut stripped = vec![prefix.join("lib/libmaru.so.0.1.0")];
    for b in [
        "maru-resource-manager",
        "maru-rm-ctl",
        "maru-remote-cxl-agent",
        "maru-rdma-check",
        "maru-server",
        "maru-usage",
    ] {
        stripped.push(prefix.join("bin").join(b));
    }
    for f in &stripped {
        let secs = sections(f);
        assert!(
            !secs.contains(".debug_info"),
            "{} is not stripped",
            f.display()
        );
        let name = f.file_name().unwrap().to_string_lossy();
        assert_eq!(
            debuglink(f).as_deref(),
            Some(format!("{name}.debug").as_str()),
            "{} names no debug file",
            f.display()
        );
        // Where gdb looks with debug-file-directory PREFIX/lib/debug.
        let rel = f.strip_prefix(&root).unwrap();
        let dbg = prefix
            .join("lib/debug")
            .join(format!("{}.debug", rel.display()));
        assert!(
            sections(&dbg).contains(".debug_info"),
            "{} holds no debug info",
            dbg.display()
        );
        let built = if name.starts_with("libmaru") {
            let so = bin_dir().join("libmaru.so");
            if so.exists() {
                so
            } else {
                bin_dir().join("deps/libmaru.so")
            }
        } else {
            bin_dir().join(&*name)
        };
        let (before, after) = (
            std::fs::metadata(&built).unwrap().len(),
            std::fs::metadata(f).unwrap().len(),
        );
        assert!(
            after < before,
            "{}: {after} bytes, built {before}",
            f.display()
        );
    }
    let a = prefix.join("lib/libmaru.a");
    if a.exists() {
        assert!(
            !sections(&a).contains(".debug_info"),
            "libmaru.a keeps its debug info"
        );
    }

    // --no-strip (make install STRIP=0) keeps everything in place and writes no debug files.
    let keep = s.dir.join("keep");
    install_with(&keep, &["--no-strip"]);
    let rm = keep.join("usr/local/bin/maru-resource-manager");
    assert!(sections(&rm).contains(".debug_info"));
    assert!(debuglink(&rm).is_none());
    assert!(!keep.join("usr/local/lib/debug").exists());

    // Uninstall removes the debug files and their directories too.
    assert!(run_script(&root, &["--uninstall"]).status.success());
    assert!(!prefix.join("lib/debug").exists(), "debug files left");
}

#[test]
fn libdir_is_respected_in_the_paths_and_in_maru_pc() {
    let s = Scratch::new("install-libdir");
    for (libdir, pc_libdir) in [
        ("lib64", "${exec_prefix}/lib64"),
        (
            "lib/x86_64-linux-gnu",
            "${exec_prefix}/lib/x86_64-linux-gnu",
        ),
        ("/opt/maru-libs", "/opt/maru-libs"),
    ] {
        let root = s.dir.join(libdir.replace('/', "_"));
        install_with(&root, &["--worker", "--libdir", libdir, "--no-strip"]);
        let dir = if libdir.starts_with('/') {
            root.join(libdir.trim_start_matches('/'))
        } else {
            root.join("usr/local").join(libdir)
        };
        for f in [
            "libmaru.so.0.1.0",
            "libmaru.so.0",
            "libmaru.so",
            "pkgconfig/maru.pc",
        ] {
            assert!(dir.join(f).symlink_metadata().is_ok(), "{libdir}: {f}");
        }
        assert!(
            !root.join("usr/local/lib/libmaru.so.0").exists() || libdir.starts_with("lib/"),
            "{libdir}: the library went to lib too"
        );
        let pc = std::fs::read_to_string(dir.join("pkgconfig/maru.pc")).unwrap();
        assert!(
            pc.lines().any(|l| l == format!("libdir={pc_libdir}")),
            "{libdir}: {pc}"
        );
        // pkg-config resolves it to the directory the library is in.
        let out = Command::new("pkg-config")
            .args(["--variable=libdir", "maru"])
            .env("PKG_CONFIG_LIBDIR", dir.join("pkgconfig"))
            .output();
        if let Some(out) = out.ok().filter(|o| o.status.success()) {
            let got = String::from_utf8_lossy(&out.stdout).trim().to_string();
            let want = if libdir.starts_with('/') {
                libdir.to_string()
            } else {
                format!("/usr/local/{libdir}")
            };
            assert_eq!(got, want, "{libdir}");
        }
        // The manifest names them where they are: uninstall removes them all.
        assert!(run_script(&root, &["--uninstall"]).status.success());
        let left = files_under(&root);
        assert!(left.is_empty(), "{libdir}: left after uninstall: {left:?}");
    }
    let bad = run_script(&s.dir.join("bad"), &["--worker", "--libdir", "../lib"]);
    assert_eq!(bad.status.code(), Some(2));
}

#[test]
fn the_metadata_node_gets_maru_server_as_user_maru_and_its_env_file_once() {
    let s = Scratch::new("install-meta");
    let root = s.dir.join("root");
    let out = install_with(&root, &["--metadata"]);
    assert!(out.contains("copy its RM key and agent key"), "{out}");
    for b in ["maru-server", "maru-usage"] {
        assert!(root.join("usr/local/bin").join(b).is_file(), "{b}");
    }
    assert!(
        !root.join("usr/local/bin/maru-resource-manager").exists(),
        "a metadata node gets no memory-node daemons"
    );
    let unit =
        std::fs::read_to_string(root.join("etc/systemd/system/maru-server.service")).unwrap();
    assert!(unit.contains("User=maru"));
    assert!(unit.contains("EnvironmentFile=/etc/maru/server.env"));
    assert!(unit.contains("ExecStart=/usr/local/bin/maru-server $MARU_SERVER_ARGS"));
    // maru-server makes its key on its first start, in a directory it may write.
    assert!(unit.contains("StateDirectory=maru"), "{unit}");
    // The env file names only what maru-server reads (its flags' env variables).
    let env_path = root.join("etc/maru/server.env");
    let env = std::fs::read_to_string(&env_path).unwrap();
    assert!(
        env.lines().any(|l| l == "MARU_SERVER_HOST=127.0.0.1"),
        "{env}"
    );
    assert!(
        env.lines()
            .any(|l| l == "MARU_SERVER_KEY_FILE=/var/lib/maru/server.key"),
        "{env}"
    );
    // Tenants: a commented line naming the variable, and where to read how.
    assert!(
        env.lines()
            .any(|l| l == "#MARU_SERVER_TENANTS=/etc/maru/tenants.toml"),
        "{env}"
    );
    assert!(env.contains("docs/operations.md, \"Tenants\""), "{env}");
    assert!(out.contains("MARU_SERVER_TENANTS"), "{out}");
    std::fs::write(&env_path, "MARU_SERVER_HOST=10.0.0.3\n").unwrap();
    assert!(install_with(&root, &["--metadata"]).contains("kept"));
    assert_eq!(
        std::fs::read_to_string(&env_path).unwrap(),
        "MARU_SERVER_HOST=10.0.0.3\n"
    );
    // Its help and a wrong combination.
    let bad = run_script(&root, &["--metadata", "--standalone"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("pick one"));
}

/// The bound agent's unit passes --create-key: the first start makes the key (0600, in
/// a 0700 directory it creates), later starts use it unchanged. Without the flag a
/// missing key refuses the start with a hint (exit 78): a standalone agent must be given
/// a copy of the pool's key, not make a key of its own that nobody else holds.
#[test]
fn the_agent_makes_its_key_on_first_start_only_when_told_to() {
    let mut s = Scratch::new("install-agentkey");
    let pool = s.fake_dax("pool");
    let rm_args = support::rm_args(&s, &pool, "64M");
    let rm = Daemon::start(RM_BIN, &rm_args, &s.dir);
    let key = s.dir.join("keys/remote-cxl-agent.key");
    let args = |create: bool| {
        let mut a = support::agent_args(&rm.addr, &key, &pool);
        if create {
            a.push("--create-key".into());
        }
        a
    };

    let (code, err) = support::refused_start(
        Command::new(AGENT_BIN)
            .args(args(false))
            .args(["--port", "0"]),
    );
    assert_eq!(code, Some(78), "{err}");
    assert!(
        err.contains("does not exist") && err.contains("--create-key"),
        "{err}"
    );
    assert!(!key.exists());

    let agent = Daemon::start(AGENT_BIN, &args(true), &s.dir);
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&key), 0o600);
    assert_eq!(mode(key.parent().unwrap()), 0o700);
    let made = maru::auth::load_key_file(&key).expect("the key the agent made loads");
    // The agent proves that key to its clients.
    let mut opts = maru::net::ClientOptions::new(maru::wire::agent::SERVICE, "install-test");
    opts.key = Some(made);
    maru::net::Client::connect(&agent.addr, &opts).expect("a client with the made key");
    let bytes = std::fs::read(&key).unwrap();
    drop(agent);

    // A restart (with or without the flag) keeps the key.
    for create in [true, false] {
        let agent = Daemon::start(AGENT_BIN, &args(create), &s.dir);
        assert_eq!(std::fs::read(&key).unwrap(), bytes);
        drop(agent);
    }
}

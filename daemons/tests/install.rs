//! scripts/install.sh into a scratch root: binaries, units, env files written once,
//! the agent key created with mode 0600, the standalone form.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use support::Scratch;

fn install(root: &Path, standalone: bool) -> String {
    install_with(root, if standalone { &["--standalone"] } else { &[] })
}

fn install_with(root: &Path, flags: &[&str]) -> String {
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_maru-resource-manager"))
        .parent()
        .unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/install.sh");
    let mut c = Command::new("bash");
    c.arg(script)
        .arg("--root")
        .arg(root)
        .arg("--bin-dir")
        .arg(bin_dir);
    c.args(flags);
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "install.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn installs_units_env_and_key_once() {
    let s = Scratch::new("install");
    let root = s.dir.join("root");
    install(&root, false);
    for b in [
        "maru-resource-manager",
        "maru-rm-ctl",
        "maru-remote-cxl-agent",
    ] {
        assert!(root.join("usr/local/bin").join(b).is_file(), "{b}");
    }
    let unit =
        std::fs::read_to_string(root.join("etc/systemd/system/maru-remote-cxl-agent.service"))
            .unwrap();
    assert!(unit.contains("BindsTo=maru-resource-manager.service"));
    assert!(unit.contains("StartLimitBurst=5"));
    assert!(unit.contains("User=maru"));
    let key = root.join("etc/maru/remote-cxl-agent.key");
    assert_eq!(
        std::fs::metadata(&key).unwrap().permissions().mode() & 0o777,
        0o600
    );
    // The key file is one the daemons accept.
    maru::auth::load_key_file(&key).expect("installed key loads");
    let key_before = std::fs::read(&key).unwrap();

    // Edits to env files survive a reinstall, and the key is not replaced.
    let env = root.join("etc/maru/remote-cxl-agent.env");
    std::fs::write(&env, "MARU_RM_ADDRESS=10.0.0.2:9850\n").unwrap();
    let out = install(&root, true);
    assert!(out.contains("kept"));
    assert_eq!(
        std::fs::read_to_string(&env).unwrap(),
        "MARU_RM_ADDRESS=10.0.0.2:9850\n"
    );
    assert_eq!(std::fs::read(&key).unwrap(), key_before);
    // The standalone form is wanted by multi-user.target, not bound to the RM.
    let unit =
        std::fs::read_to_string(root.join("etc/systemd/system/maru-remote-cxl-agent.service"))
            .unwrap();
    assert!(unit.contains("WantedBy=multi-user.target"));
    assert!(!unit.contains("BindsTo="));
}

#[test]
fn a_fresh_standalone_install_leaves_the_rm_address_to_fill_in() {
    let s = Scratch::new("install-sa");
    let root = s.dir.join("root");
    install(&root, true);
    let env = std::fs::read_to_string(root.join("etc/maru/remote-cxl-agent.env")).unwrap();
    assert!(env.lines().any(|l| l == "MARU_RM_ADDRESS="), "{env}");
}

#[test]
fn the_metadata_node_gets_maru_server_as_user_maru_and_its_env_file_once() {
    let s = Scratch::new("install-meta");
    let root = s.dir.join("root");
    let out = install_with(&root, &["--metadata"]);
    assert!(out.contains("copy the agent key"), "{out}");
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
    // The env file names only what maru-server reads (its flags' env variables).
    let env_path = root.join("etc/maru/server.env");
    let env = std::fs::read_to_string(&env_path).unwrap();
    assert!(
        env.lines().any(|l| l == "MARU_SERVER_HOST=127.0.0.1"),
        "{env}"
    );
    std::fs::write(&env_path, "MARU_SERVER_HOST=10.0.0.3\n").unwrap();
    assert!(install_with(&root, &["--metadata"]).contains("kept"));
    assert_eq!(
        std::fs::read_to_string(&env_path).unwrap(),
        "MARU_SERVER_HOST=10.0.0.3\n"
    );
    // Its help and a wrong combination.
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/install.sh");
    let bad = Command::new("bash")
        .arg(&script)
        .args(["--metadata", "--standalone", "--root"])
        .arg(&root)
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("pick one"));
}

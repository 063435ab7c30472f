#!/usr/bin/env bash
# The Debian packages as a host gets them (make deb-test; root, on a host without Maru):
# dpkg -i the packages of DIR into this machine; checks what they installed (no key,
# stripped programs with their debug files, enabled units, the user maru, pkg-config);
# starts the installed daemons the way their units say (user, env file, ExecStart, state
# directories), since no systemd runs in CI; checks the keys they made on their first
# start; runs examples/c/share_kv.c, built with the installed header, against the
# installed library and daemons on both backends, and a program linked with
# `pkg-config --libs maru`; stops the daemons; dpkg --purge, then checks that nothing
# is left: files, units' links, keys, state, the user and group maru.
# Usage: scripts/deb-test.sh DIR (the .deb files of make deb; default target/debian)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
debs=$(cd "${1:-$root/target/debian}" && pwd)
packages=(libmaru0 libmaru-dev maru-memory-node maru-metadata-node maru-dbg)
fail() { echo "deb-test: FAILED: $*" >&2; exit 1; }
# has_section FILE NAME: the ELF file has that section (readelf's output read whole: a
# `readelf | grep -q` pipeline fails on SIGPIPE under pipefail).
has_section() { local s; s=$(readelf -SW "$1" 2>/dev/null) || fail "readelf $1"; case "$s" in *" $2 "*) ;; *) return 1 ;; esac; }
step() { echo "== deb-test: $*"; }

[ "$(id -u)" = 0 ] || { echo "deb-test: run as root (it installs into this machine)" >&2; exit 2; }
files=()
for p in "${packages[@]}"; do
    f=$(ls "$debs/${p}_"*.deb 2>/dev/null | tail -1)
    [ -n "$f" ] || { echo "deb-test: no ${p}_*.deb in $debs: run make deb" >&2; exit 2; }
    files+=("$f")
done
installed() { dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null | grep -qv '^not-installed$'; }
for p in "${packages[@]}"; do
    installed "$p" && { echo "deb-test: $p is installed on this host already; deb-test installs and purges it: run it on a host without Maru" >&2; exit 2; }
done
for what in /etc/maru /var/lib/maru /var/lib/maru-rm; do
    [ ! -e "$what" ] || { echo "deb-test: $what exists on this host (an earlier make install?); deb-test would purge it: run it on a host without Maru" >&2; exit 2; }
done
getent passwd maru >/dev/null && { echo "deb-test: the user maru exists on this host; deb-test would remove it: run it on a host without Maru" >&2; exit 2; }

work=$(mktemp -d /tmp/maru-deb-test.XXXXXX)
pool=/dev/shm/maru-deb-test-$$
pids=()
stop_daemons() {
    local i
    for ((i=${#pids[@]}-1; i>=0; i--)); do
        kill "${pids[$i]}" 2>/dev/null || true
        for _ in $(seq 1 100); do kill -0 "${pids[$i]}" 2>/dev/null || break; sleep 0.1; done
        kill -9 "${pids[$i]}" 2>/dev/null || true
        wait "${pids[$i]}" 2>/dev/null || true
    done
    pids=()
}
cleanup() {
    stop_daemons
    local left=()
    for p in "${packages[@]}"; do installed "$p" && left+=("$p"); done
    [ ${#left[@]} -eq 0 ] || dpkg --purge "${left[@]}" >/dev/null 2>&1 || true
    rm -rf "$work" "$pool"
}
trap cleanup EXIT

step "dpkg -i ${files[*]##*/}"
dpkg -i "${files[@]}" > "$work/dpkg-install.log" 2>&1 || { cat "$work/dpkg-install.log"; fail "dpkg -i"; }
for p in "${packages[@]}"; do
    dpkg-query -W -f='${db:Status-Status}' "$p" | grep -qx installed || fail "$p is not installed after dpkg -i"
    dpkg -L "$p" > "$work/$p.files"
done
multiarch=$(dpkg -L libmaru0 | sed -n 's|^/usr/lib/\([^/]*\)/libmaru\.so\.0$|\1|p')
[ -n "$multiarch" ] || fail "libmaru0 has no /usr/lib/<multiarch>/libmaru.so.0"
lib=/usr/lib/$multiarch/libmaru.so.0

step "what the packages installed"
! cat "$work"/*.files | grep -E '\.key$' || fail "a package ships a key file"
[ -z "$(ls -A /var/lib/maru)" ] || fail "/var/lib/maru is not empty after install: $(ls -A /var/lib/maru)"
[ "$(stat -c '%U:%G %a' /var/lib/maru)" = "maru:maru 700" ] || fail "/var/lib/maru is $(stat -c '%U:%G %a' /var/lib/maru)"
getent passwd maru | grep -q ':/usr/sbin/nologin$' || fail "the user maru: $(getent passwd maru)"
for b in maru-resource-manager maru-remote-cxl-agent maru-rm-ctl maru-rdma-check maru-server maru-usage "$lib"; do
    f=$b; [ "${b#/}" = "$b" ] && f=/usr/bin/$b
    f=$(readlink -f "$f")
    has_section "$f" .gnu_debuglink || fail "$f names no debug file (.gnu_debuglink)"
    ! has_section "$f" .debug_info || fail "$f is not stripped"
    has_section "/usr/lib/debug$f.debug" .debug_info || fail "/usr/lib/debug$f.debug (maru-dbg) has no debug information"
done
! has_section "/usr/lib/$multiarch/libmaru.a" .debug_info || fail "libmaru.a is not stripped"
# Enabled without systemd running (deb-systemd-helper), not started.
for link in multi-user.target.wants/maru-resource-manager.service \
            maru-resource-manager.service.wants/maru-remote-cxl-agent.service \
            multi-user.target.wants/maru-server.service; do
    [ -L "/etc/systemd/system/$link" ] || fail "/etc/systemd/system/$link: the unit is not enabled"
done
[ ! -e /etc/systemd/system/multi-user.target.wants/maru-remote-cxl-agent-standalone.service ] ||
    fail "the standalone agent unit is enabled beside the bound one"
# The units as systemd reads them, against the installed programs (offline: no
# systemd needs to run).
if command -v systemd-analyze >/dev/null; then
    # (an unknown or misspelt setting is only a warning, exit 0: any output fails)
    out=$(systemd-analyze verify /usr/lib/systemd/system/maru-*.service 2>&1) && [ -z "$out" ] ||
        fail "systemd-analyze verify: $out"
fi
grep -q '^ExecStart=/usr/bin/maru-remote-cxl-agent --create-key ' /usr/lib/systemd/system/maru-remote-cxl-agent.service ||
    fail "the agent's unit does not start /usr/bin/maru-remote-cxl-agent --create-key"
[ "$(pkg-config --modversion maru)" = "$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/Cargo.toml" | head -1)" ] ||
    fail "pkg-config --modversion maru: $(pkg-config --modversion maru 2>&1)"
[ "$(pkg-config --variable=libdir maru)" = "/usr/lib/$multiarch" ] || fail "maru.pc libdir $(pkg-config --variable=libdir maru)"
cache=$(ldconfig -p)
# (/lib/<multiarch> or /usr/lib/<multiarch>: the same directory where /lib is /usr/lib)
grep -Eq "libmaru\.so\.0 .*=> (/usr)?/lib/$multiarch/libmaru\.so\.0\$" <<<"$cache" || fail "ldconfig does not know $lib (the libmaru0 trigger)"

step "a program linked with pkg-config --cflags --libs maru"
# shellcheck disable=SC2046 # the flags are a list
cc -std=c11 -Wall -Wextra -Werror "$root/ctests/installed_program.c" $(pkg-config --cflags --libs maru) -o "$work/program"
"$work/program"

# The env files, edited as an operator does: a fake-DAX pool, free loopback ports,
# regions and chunks small enough for it.
set_env() { # file key value
    grep -q "^$2=" "$1" || fail "$1 has no $2"
    sed -i "s|^$2=.*|$2=$3|" "$1"
}
read -r rm_port agent_port server_port < <(python3 -c '
import socket
ss = [socket.socket() for _ in range(3)]
for s in ss: s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in ss])')
set_env /etc/maru/resource-manager.env MARU_RM_PORT "$rm_port"
set_env /etc/maru/resource-manager.env MARU_RM_ARGS "--fake-dax $pool:256M"
set_env /etc/maru/remote-cxl-agent.env MARU_RM_ADDRESS "127.0.0.1:$rm_port"
set_env /etc/maru/remote-cxl-agent.env MARU_REMOTE_CXL_AGENT_PORT "$agent_port"
set_env /etc/maru/remote-cxl-agent.env MARU_AGENT_ARGS "--device $pool --node deb-test"
set_env /etc/maru/server.env MARU_RM_ADDRESS "127.0.0.1:$rm_port"
set_env /etc/maru/server.env MARU_SERVER_PORT "$server_port"
set_env /etc/maru/server.env MARU_SERVER_ARGS "--remote-cxl-agent 127.0.0.1:$agent_port --region-size 16M --chunk-size 256K"

# Starts a unit's ExecStart as systemd would: as its User=, with only its
# EnvironmentFile= (and RUST_LOG), $VAR split into words, its StateDirectory= made
# with StateDirectoryMode=; waits (<= 20 s) until it listens on PORT.
start_unit() { # unit port
    local unit=/usr/lib/systemd/system/$1.service key value w user mode
    [ -f "$unit" ] || fail "$unit not installed"
    user=$(sed -n 's/^User=//p' "$unit")
    mode=$(sed -n 's/^StateDirectoryMode=//p' "$unit")
    for d in $(sed -n 's/^StateDirectory=//p' "$unit"); do
        install -d -o "$user" -g "$user" -m "${mode:-0755}" "/var/lib/$d"
    done
    local -A envmap=()
    local envs=(PATH=/usr/sbin:/usr/bin:/sbin:/bin "RUST_LOG=${RUST_LOG:-info}")
    while IFS= read -r line; do
        case "$line" in ''|'#'*) continue ;; esac
        key=${line%%=*}; value=${line#*=}
        envmap[$key]=$value
        envs+=("$key=$value")
    done < "$(sed -n 's/^EnvironmentFile=//p' "$unit")"
    local args=()
    set -f
    for w in $(sed -n 's/^ExecStart=//p' "$unit"); do
        if [[ $w =~ ^\$([A-Za-z_][A-Za-z0-9_]*)$ ]]; then
            # shellcheck disable=SC2206 # systemd splits $VAR into words
            args+=(${envmap[${BASH_REMATCH[1]}]:-})
        else
            args+=("$w")
        fi
    done
    set +f
    setpriv --reuid="$user" --regid="$user" --init-groups env -i "${envs[@]}" "${args[@]}" \
        > "$work/$1.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 1 200); do
        kill -0 "${pids[-1]}" 2>/dev/null || { cat "$work/$1.log"; fail "$1 exited at start"; }
        (exec 3<>"/dev/tcp/127.0.0.1/$2") 2>/dev/null && { echo "$1 listens on 127.0.0.1:$2 (${args[*]})"; return 0; }
        sleep 0.1
    done
    cat "$work/$1.log"
    fail "$1 does not listen on 127.0.0.1:$2 after 20 s"
}

step "the installed daemons, started as their units say"
start_unit maru-resource-manager "$rm_port"
start_unit maru-remote-cxl-agent "$agent_port"
start_unit maru-server "$server_port"
for k in resource-manager remote-cxl-agent server; do
    f=/var/lib/maru/$k.key
    [ "$(stat -c '%U %a' "$f" 2>/dev/null)" = "maru 600" ] || fail "$f was not made (mode 0600, owner maru) on the first start"
done

step "examples/c against the installed library and daemons"
# shellcheck disable=SC2046 # the flags are a list
cc -std=c11 -Wall -Wextra $(pkg-config --cflags maru) "$root/examples/c/share_kv.c" -ldl -o "$work/share_kv"
export MARU_SERVER_KEY_FILE=/var/lib/maru/server.key
for backend in remote_cxl cxl; do
    cfg() { printf '{"backend":"%s","server_url":"127.0.0.1:%s","engine_id":"%s","agent_key_file":"/var/lib/maru/remote-cxl-agent.key"}' \
        "$backend" "$server_port" "$1"; }
    printf '%-10s ' "$backend:"
    RUST_LOG=${RUST_LOG:-error} "$work/share_kv" "$lib" "$(cfg deb-test-$backend-a)" "$(cfg deb-test-$backend-b)" 64
done
unset MARU_SERVER_KEY_FILE
stop_daemons

step "dpkg --purge ${packages[*]}"
dpkg --purge "${packages[@]}" > "$work/dpkg-purge.log" 2>&1 || { cat "$work/dpkg-purge.log"; fail "dpkg --purge"; }
for p in "${packages[@]}"; do
    ! installed "$p" || fail "$p is still known to dpkg after --purge"
done
left=$(cat "$work"/*.files | sort -u | while IFS= read -r f; do
    [ -e "$f" ] && [ ! -d "$f" ] && echo "$f"
    [ -d "$f" ] && [ -n "$(ls -A "$f" | grep -i maru)" ] && echo "$f/*maru*"
done || true)
[ -z "$left" ] || fail "left after purge: $left"
for what in /etc/maru /var/lib/maru /var/lib/maru-rm; do
    [ ! -e "$what" ] || fail "$what is left after purge: $(ls -lA "$what")"
done
! getent passwd maru >/dev/null || fail "the user maru is left after purge"
! getent group maru >/dev/null || fail "the group maru is left after purge"
left=$(find /etc/systemd /var/lib/systemd -name '*maru*' 2>/dev/null || true)
[ -z "$left" ] || fail "systemd links or deb-systemd-helper state left after purge: $left"
cache=$(ldconfig -p)
! grep -q libmaru <<<"$cache" || fail "ldconfig still lists libmaru after purge"
echo "deb-test: ok (installed, ran the installed daemons and library, purged with nothing left)"

"""Real daemons on loopback for the binding's tests, started once per session from the
cargo build (``MARU_BIN_DIR``, else the directory of ``MARU_LIB`` when it holds the
daemons, else ``target/debug`` above the current directory or this file): maru-resource-manager on a fake DAX file in /dev/shm, a maru-remote-cxl-agent and
maru-server, each on a free port (``--port 0`` + ``--ready-file``). They are stopped in
reverse order (SIGTERM, bounded wait, then SIGKILL) and their files removed
(``MARU_PYTEST_KEEP_LOGS=DIR`` keeps their logs under DIR)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import pytest
from daemon_procs import start_ready, stop

CHUNK_SIZE = 64 * 1024
# The backends the tests that take ``backend`` run on.
BACKENDS = ["remote_cxl", "cxl"]


def pattern(tag: str, n: int) -> bytes:
    """``n`` bytes that follow from ``tag`` alone (a chunk any reader can check)."""
    return (hashlib.sha256(tag.encode()).digest() * (n // 32 + 1))[:n]


def errors_of_threads(
    work: Callable[[int], None], n: int = 4, timeout: float = 120
) -> List[BaseException]:
    """Runs ``work(t)`` for ``t`` in ``range(n)`` on threads of their own at once (each
    joined within ``timeout`` seconds): what they raised, none: ``[]``."""
    import threading

    errors: List[BaseException] = []

    def run(t: int) -> None:
        try:
            work(t)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return errors


@contextlib.contextmanager
def engines(
    config: Callable[..., Dict[str, Any]], backend: str, ns: str, *names: str
) -> Iterator[List[Any]]:
    """Handlers of ``backend`` in namespace ``ns``, one per name (engine ``{name}-{ns}``),
    closed when the block ends."""
    from maru import Handler

    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(Handler(config(backend, f"{n}-{ns}", namespace=ns)))
            for n in names
        ]


@contextlib.contextmanager
def compat_handlers(
    compat_config: Callable[..., Any], backend: str, ns: str, n: int = 2
) -> Iterator[List[Any]]:
    """``n`` upstream-compatible handlers (``maru.compat.MaruHandler``) of ``backend``
    in the cache namespace ``ns``, closed when the block ends."""
    from maru.compat import MaruHandler

    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(MaruHandler(compat_config(backend, cache_namespace=ns)))
            for _ in range(n)
        ]


def check_close_releases(
    h: Any, buf: Any, mv: memoryview, refused: List[Callable[[], Any]]
) -> None:
    """Closing handler ``h`` releases ``buf`` (a slot or a view) and its memoryview
    ``mv``; each of ``refused`` then raises ``ClosedError``; releasing ``buf`` again is
    harmless."""
    import maru

    h.close()
    assert buf.released
    with pytest.raises(ValueError):
        mv[0]
    for call in refused:
        with pytest.raises(maru.ClosedError):
            call()
    buf.release()  # harmless


def check_numpy_keeps(h: Any, buf: Any, close_match: str, use: Callable[[Any], None]) -> None:
    """A numpy array over ``buf.view`` (a slot or a view of handler ``h``) keeps ``buf``
    and ``h``: ``buf``'s release and ``h``'s close are refused while it lives, and it
    stays usable (``use(array)`` passes); once it is gone ``h`` closes, releasing
    ``buf``."""
    np = pytest.importorskip("numpy")
    from maru import SlotReleasedError

    arr = np.frombuffer(buf.view, dtype=np.uint8)
    with pytest.raises(BufferError):
        buf.release()
    with pytest.raises(BufferError, match=close_match):
        h.close()
    assert not h.closed
    use(arr)
    del arr
    h.close()
    assert h.closed and buf.released
    with pytest.raises(SlotReleasedError, match="closed"):
        buf.view


def check_a_slice_keeps(buf: Any, check_part: Callable[[memoryview], None]) -> None:
    """A slice of ``buf.view`` (a slot or a view) keeps ``buf``: its release is refused
    while the slice lives, and ``buf`` stays valid (``check_part(slice)`` passes); once
    the slice is gone it releases."""
    part = buf.view[10:20]
    with pytest.raises(BufferError, match="still alive"):
        buf.release()
    assert not buf.released
    check_part(part)
    del part
    buf.release()
    assert buf.released


def _bin_dir() -> Path:
    env = os.environ.get("MARU_BIN_DIR")
    if env:
        return Path(env)
    lib = os.environ.get("MARU_LIB")
    if lib:
        d = Path(lib) if Path(lib).is_dir() else Path(lib).parent
        if (d / "maru-server").is_file():
            return d
    for d in (Path.cwd(), *Path(__file__).resolve().parents):
        cand = d / "target" / "debug"
        if (cand / "maru-server").is_file():
            return cand
    raise RuntimeError("daemons not built: run `cargo build --workspace --bins` or set MARU_BIN_DIR (or MARU_LIB)")


class Daemons:
    """The daemons of one test session and their addresses (``rm``, ``agent``,
    ``server``), the agent key file (``key``), maru-server's key file (``server_key``,
    made by maru-server on its first start) and the fake DAX file (``pool``)."""

    def __init__(self) -> None:
        self.bin = _bin_dir()
        self.work = Path(tempfile.mkdtemp(prefix="maru-pytest-"))
        self.pool = Path(f"/dev/shm/maru-pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.procs: List[subprocess.Popen] = []
        self.key = self.work / "agent.key"
        self.server_key = self.work / "server.key"
        self.rm = self.agent = self.server = ""
        subprocess.run(
            [str(self.bin / "maru-rm-ctl"), "gen-key", str(self.key)], check=True, capture_output=True, timeout=30
        )

    def start(self, name: str, *args: str) -> str:
        """Starts ``name`` with ``args`` on a free port; returns its address once it listens."""
        p, addr = start_ready(
            [str(self.bin / name), *args], self.work / f"{name}.ready", self.work / f"{name}.log"
        )
        self.procs.append(p)
        return addr

    def stop(self) -> None:
        """Stops the daemons in reverse order (maru-server gives its regions back while
        the agent and the RM still run) and removes the files."""
        for p in reversed(self.procs):
            stop(p)
        self.procs.clear()
        keep = os.environ.get("MARU_PYTEST_KEEP_LOGS")
        if keep:
            # The daemons' logs outlive the run (a failure under load is read afterwards).
            dest = Path(keep) / self.work.name
            dest.mkdir(parents=True, exist_ok=True)
            for f in self.work.glob("*.log"):
                shutil.copy(f, dest / f.name)
        self.pool.unlink(missing_ok=True)
        shutil.rmtree(self.work, ignore_errors=True)

    @contextlib.contextmanager
    def extra_server(self, name: str, *args: str, env: Optional[Dict[str, str]] = None) -> Iterator[str]:
        """Another maru-server of the session's RM (8M regions, 64K chunks, in memory),
        with ``args`` and ``env`` (default: this process's); its address while the block
        runs, stopped after. Its output goes to ``NAME.log`` in the work directory."""
        p, addr = start_ready(
            [
                str(self.bin / "maru-server"),
                "--rm-address", self.rm,
                "--rm-key-file", str(self.work / "rm" / "rm.key"),
                "--region-size", "8M",
                "--chunk-size", "64K",
                "--in-memory",
                *args,
            ],
            self.work / f"{name}.ready",
            self.work / f"{name}.log",
            env=dict(os.environ) if env is None else env,
        )
        try:
            yield addr
        finally:
            stop(p)

    def addresses(self) -> Dict[str, str]:
        return {"rm": self.rm, "agent": self.agent, "server": self.server}


@pytest.fixture(scope="session")
def daemons() -> Iterator[Daemons]:
    d = Daemons()
    try:
        d.rm = d.start("maru-resource-manager", "--state-dir", str(d.work / "rm"), "--fake-dax", f"{d.pool}:1G")
        d.agent = d.start(
            "maru-remote-cxl-agent",
            "--rm-address", d.rm,
            "--rm-key-file", str(d.work / "rm" / "rm.key"),
            "--key-file", str(d.key),
            "--device", str(d.pool),
            "--node", "pytest",
        )
        d.server = d.start(
            "maru-server",
            "--rm-address", d.rm,
            "--rm-key-file", str(d.work / "rm" / "rm.key"),
            "--remote-cxl-agent", d.agent,
            "--remote-cxl-agent-key-file", str(d.key),
            "--key-file", str(d.server_key),
            "--region-size", "8M",
            "--chunk-size", "64K",
        )
        # maru-server made its key on first start; handlers whose configuration names
        # none (compat, vLLM settings) prove the one MARU_SERVER_KEY_FILE names.
        before = os.environ.get("MARU_SERVER_KEY_FILE")
        os.environ["MARU_SERVER_KEY_FILE"] = str(d.server_key)
        try:
            yield d
        finally:
            if before is None:
                os.environ.pop("MARU_SERVER_KEY_FILE", None)
            else:
                os.environ["MARU_SERVER_KEY_FILE"] = before
    finally:
        d.stop()


@pytest.fixture
def ns() -> str:
    """A fresh namespace (and key prefix) for one test."""
    return uuid.uuid4().hex


@pytest.fixture
def config(daemons: Daemons) -> Callable[..., Dict[str, Any]]:
    """``config(backend, engine_id, **overrides)``: a handler configuration for the
    session's daemons."""

    def make(backend: str, engine: str, **extra: Any) -> Dict[str, Any]:
        c: Dict[str, Any] = {
            "backend": backend,
            "server_url": daemons.server,
            "server_key_file": str(daemons.server_key),
            "engine_id": engine,
            "namespace": "pytest",
            "agent_key_file": str(daemons.key),
            "load_slots": 8,
            "store_slots": 8,
            "timeout_ms": 5000,
        }
        c.update(extra)
        return c

    return make


@pytest.fixture
def compat_config(daemons: Daemons) -> Callable[..., Any]:
    """``compat_config(backend, **fields)``: an upstream-style ``maru.compat.MaruConfig``
    for the session's daemons (``chunk_size_bytes`` = their chunk size)."""
    from maru.compat import MaruConfig

    def make(backend: str, **extra: Any) -> Any:
        fields: Dict[str, Any] = dict(
            server_url=f"tcp://{daemons.server}",
            chunk_size_bytes=CHUNK_SIZE,
            storage_backend=backend,
            agent_key_file=str(daemons.key),
            cache_namespace="pytest-compat",
            load_slots=8,
            store_slots=8,
            timeout_ms=5000,
        )
        fields.update(extra)
        return MaruConfig(**fields)

    return make

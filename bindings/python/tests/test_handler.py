"""The binding against real daemons (conftest.py), on both backends."""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import threading
import time
from typing import List

import pytest

import maru
from maru import (
    BufferTooSmallError,
    ClosedError,
    ConfigError,
    InvalidArgumentError,
    Handler,
    UnavailableError,
    chunk_keys,
)

from conftest import BACKENDS, CHUNK_SIZE, pattern


def payload(i: int, n: int = 40_000) -> bytes:
    return pattern(str(i), n)


def digests(chunks: List[bytes]) -> List[str]:
    return [hashlib.sha256(c).hexdigest() for c in chunks]


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_engines_share_chunks(backend, config, ns):
    with Handler(config(backend, f"a-{ns}", namespace=ns)) as a, Handler(
        config(backend, f"b-{ns}", namespace=ns)
    ) as b:
        assert a.chunk_size() == b.chunk_size() == CHUNK_SIZE
        keys = [f"{ns}-{i}" for i in range(40)]
        data = [payload(i) for i in range(40)]
        for k, d in zip(keys, data):
            assert a.store(k, d, route_key=keys[0])
        assert all(b.exists(k, route_key=keys[0]) for k in keys)
        got = [b.retrieve(k, route_key=keys[0]) for k in keys]
        assert digests(got) == digests(data)
        assert b.stats()["total"]["hits"] >= 40
        # Calls by kind, with a latency histogram (maru_stats_json's "ops").
        store = a.stats()["ops"]["store"]
        assert (store["ok"], store["failed"], store["items"]) == (40, 0, 40)
        bounds = [le for le, _ in store["latency_us_le"]]
        assert bounds == sorted(bounds) and store["latency_us_le"][-1][1] <= 40


@pytest.mark.parametrize("backend", BACKENDS)
def test_engines_with_a_common_prompt_prefix_share_its_chunks(backend, config, ns):
    chunk_tokens = 64
    common = list(range(1000, 1000 + 3 * chunk_tokens))
    prompt_a = common + [7] * chunk_tokens
    prompt_b = common + [8] * chunk_tokens + [9] * 10
    keys_a, keys_b = chunk_keys(prompt_a, chunk_tokens, ns), chunk_keys(prompt_b, chunk_tokens, ns)
    assert keys_a[:3] == keys_b[:3] and keys_a[3] != keys_b[3] and len(keys_b) == 4
    kv = {k: payload(i, 30_000) for i, k in enumerate(keys_a)}
    with Handler(config(backend, f"a-{ns}", namespace=ns)) as a:
        assert all(a.batch_store([(k, kv[k]) for k in keys_a]))
    # a has closed: its chunks stay readable for b (region keeper).
    with Handler(config(backend, f"b-{ns}", namespace=ns)) as b:
        assert b.batch_exists(keys_b) == [True, True, True, False]
        got = b.batch_retrieve(keys_b)
        assert got[3] is None
        assert digests(got[:3]) == digests([kv[k] for k in keys_a[:3]])
        total = b.stats()["total"]
        assert total["hits"] >= 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_batches(backend, config, ns):
    with Handler(config(backend, f"e-{ns}", namespace=ns)) as h:
        keys = [f"{ns}-{i}" for i in range(20)]
        data = [payload(i, 1000 + 3000 * i) for i in range(20)]
        items = [(k, d if i % 3 else memoryview(bytearray(d))) for i, (k, d) in enumerate(zip(keys, data))]
        assert h.batch_store(items, route_key=keys[0]) == [True] * 20
        assert h.batch_store([]) == [] and h.batch_retrieve([]) == [] and h.batch_exists([]) == []
        missing = f"{ns}-missing"
        assert h.batch_exists(keys + [missing], route_key=keys[0]) == [True] * 20 + [False]
        got = h.batch_retrieve(keys + [missing], route_key=keys[0])
        assert got[-1] is None
        assert digests(got[:-1]) == digests(data)
        # Into caller buffers, without copies; a miss between hits leaves its buffer alone
        # and each hit lands in its own.
        bufs = [bytearray(CHUNK_SIZE) for _ in range(3)]
        lens = h.batch_retrieve_into([keys[0], missing, keys[1]], bufs, route_key=keys[0])
        assert lens == [len(data[0]), None, len(data[1])]
        assert bytes(bufs[0][: lens[0]]) == data[0] and bytes(bufs[2][: lens[2]]) == data[1]
        assert bufs[1] == bytearray(CHUNK_SIZE)
        with pytest.raises(BufferTooSmallError) as e:
            h.batch_retrieve_into([keys[5]], [bytearray(100)], route_key=keys[0])
        assert e.value.needed == len(data[5])
        with pytest.raises(ValueError):
            h.batch_retrieve_into(keys[:2], bufs[:1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_buffers_in_and_out(backend, config, ns):
    with Handler(config(backend, f"e-{ns}", namespace=ns)) as h:
        src = bytearray(payload(7))
        ro = bytes(src)
        assert h.store(f"{ns}-ba", src)
        assert h.store(f"{ns}-mv", memoryview(src)[100:2100])  # writable slice
        assert h.store(f"{ns}-romv", memoryview(ro)[5:30005])  # read-only slice: no copy either
        assert h.store(f"{ns}-bytes", ro)
        src.extend(b"!")  # no buffer export left behind by store
        raw = (ctypes.c_char * 5000).from_buffer_copy(ro[:5000])
        assert h.store_ptr(f"{ns}-ptr", ctypes.addressof(raw), 5000)

        out = bytearray(CHUNK_SIZE)
        n = h.retrieve_into(f"{ns}-ba", out)
        assert n == len(ro) and out[:n] == ro
        view = memoryview(bytearray(4096))
        assert h.retrieve_into(f"{ns}-mv", view) == 2000
        assert view[:2000].tobytes() == ro[100:2100]
        assert h.retrieve(f"{ns}-romv") == ro[5:30005]
        assert h.retrieve(f"{ns}-bytes") == ro
        assert h.retrieve(f"{ns}-ptr") == ro[:5000]
        # Into part of a larger buffer.
        big = bytearray(3 * CHUNK_SIZE)
        assert h.retrieve_into(f"{ns}-mv", memoryview(big)[CHUNK_SIZE:]) == 2000
        assert big[CHUNK_SIZE : CHUNK_SIZE + 2000] == ro[100:2100] and not any(big[:CHUNK_SIZE])

        with pytest.raises(BufferTooSmallError) as e:
            h.retrieve_into(f"{ns}-ba", bytearray(1000))
        assert e.value.needed == len(ro) and isinstance(e.value, InvalidArgumentError)
        assert str(len(ro)) in str(e.value)
        with pytest.raises(TypeError):
            h.retrieve_into(f"{ns}-ba", ro)  # read-only
        with pytest.raises(ValueError):
            h.store(f"{ns}-strided", memoryview(src)[::2])  # not contiguous


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_arrays(backend, config, ns):
    np = pytest.importorskip("numpy")
    with Handler(config(backend, f"np-{ns}", namespace=ns)) as h:
        arr = np.arange(4096, dtype=np.float32).reshape(64, 64)
        assert h.store(f"{ns}-arr", arr)
        ro = arr.copy()
        ro.flags.writeable = False
        assert h.store(f"{ns}-ro", ro[10:20])
        assert h.store_ptr(f"{ns}-ptr", arr.ctypes.data, arr.nbytes)
        out = np.zeros_like(arr)
        assert h.retrieve_into(f"{ns}-arr", out) == arr.nbytes
        assert (out == arr).all()
        out2 = np.zeros((10, 64), dtype=np.float32)
        assert h.retrieve_into(f"{ns}-ro", out2) == out2.nbytes
        assert (out2 == arr[10:20]).all()
        assert np.frombuffer(h.retrieve(f"{ns}-ptr"), dtype=np.float32).reshape(64, 64).tolist() == arr.tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_miss_is_none(backend, config, ns):
    with Handler(config(backend, f"miss-{ns}", namespace=ns)) as h:
        assert h.retrieve(f"{ns}-never") is None
        assert h.retrieve_into(f"{ns}-never", bytearray(10)) is None
        assert not h.exists(f"{ns}-never")
        assert h.stats()["total"]["misses"] >= 1


def test_bad_arguments_are_refused(config, ns):
    with Handler(config("cxl", f"big-{ns}", namespace=ns)) as h:
        with pytest.raises(InvalidArgumentError):
            h.store(f"{ns}-too-big", b"x" * (h.chunk_size() + 1))
        with pytest.raises(InvalidArgumentError, match="empty"):
            h.store("", b"x")
        with pytest.raises(InvalidArgumentError, match="NUL"):
            h.store("a\0b", b"x")
        with pytest.raises(TypeError):
            h.store(b"bytes-key", b"x")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            h.store(f"{ns}-str", "not bytes")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            h.store(f"{ns}-empty", b"")
        assert not h.exists(f"{ns}-too-big")


@pytest.mark.parametrize(
    "extra,field",
    [({"load_slot": 3}, "load_slot"), ({"backend": "nvme"}, "nvme"), ({"async_threads": 0}, "async_threads")],
)
def test_bad_config_names_the_field(config, extra, field):
    bad = config("cxl", "x")
    bad.update(extra)
    with pytest.raises(ConfigError) as e:
        Handler(bad)
    assert field in str(e.value) and e.value.code == maru.Status.CONFIG
    c = config("cxl", "x")
    del c["server_url"]
    with pytest.raises(ConfigError, match="server_url"):
        Handler(c)
    with pytest.raises(ConfigError):
        Handler("{not json")


def test_no_server_is_unavailable(config):
    with pytest.raises(UnavailableError, match="127.0.0.1:1"):
        Handler(config("remote_cxl", "nobody", server_url="127.0.0.1:1"))


def test_a_closed_handler_refuses_calls(config, ns):
    h = Handler(config("cxl", f"closing-{ns}", namespace=ns))
    assert h.store(f"{ns}-k", b"v")
    with h:
        pass  # __exit__ closes
    assert h.closed
    h.close()
    for call in (
        lambda: h.store("k", b"v"),
        lambda: h.store_ptr("k", 1, 1),
        lambda: h.retrieve("k"),
        lambda: h.retrieve_into("k", bytearray(10)),
        lambda: h.exists("k"),
        lambda: h.batch_store([("k", b"v")]),
        lambda: h.batch_retrieve(["k"]),
        lambda: h.batch_exists(["k"]),
        lambda: h.stats(),
        lambda: h.chunk_size(),
        lambda: h.acquire_slots(maru.SlotPool.LOAD, 1),
        lambda: h.acquire_slot(maru.SlotPool.STORE),
    ):
        with pytest.raises(ClosedError) as e:
            call()
        assert e.value.code == maru.Status.CLOSED
    # What it stored outlives it.
    with Handler(config("cxl", f"reader-{ns}", namespace=ns)) as r:
        assert r.retrieve(f"{ns}-k") == b"v"


@pytest.mark.parametrize("backend", BACKENDS)
def test_threads_and_close(backend, config, ns):
    h = Handler(config(backend, f"threads-{ns}", namespace=ns))
    errors: List[BaseException] = []
    closed = []
    start = threading.Barrier(5)

    def worker(t: int) -> None:
        start.wait(timeout=10)
        deadline = time.monotonic() + 10  # runs until close() stops it (bounded)
        try:
            for i in itertools.takewhile(lambda _: time.monotonic() < deadline, itertools.count()):
                k = f"{ns}-{t}-{i % 10}"
                h.store(k, payload(t * 100 + i % 10, 5000))
                got = h.retrieve(k)
                assert got is None or got == payload(t * 100 + i % 10, 5000)
        except ClosedError:
            closed.append(t)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    start.wait(timeout=10)
    h.close()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    assert errors == []
    assert closed, "close() did not overlap the workers"


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_wakes_a_thread_waiting_for_a_slot(backend, config, ns):
    # close() shuts libmaru's handler down before it waits for Python's calls in
    # flight: a thread blocked in acquire_slots gets ClosedError at once (not a
    # NoSpaceError when its timeout ends) and close returns without waiting it out.
    h = Handler(config(backend, f"wake-{ns}", namespace=ns, store_slots=2))
    held = h.acquire_slots(maru.SlotPool.STORE, 2)
    while len(held) < 2:
        held += h.acquire_slots(maru.SlotPool.STORE, 2 - len(held))
    outcome: List[object] = []
    waiting = threading.Event()

    def waiter() -> None:
        waiting.set()
        t0 = time.monotonic()
        try:
            h.acquire_slots(maru.SlotPool.STORE, 1, timeout=6)
            outcome.append("got a slot")
        except BaseException as e:  # noqa: BLE001
            outcome.append(e)
        outcome.append(time.monotonic() - t0)

    t = threading.Thread(target=waiter)
    t.start()
    assert waiting.wait(timeout=10)
    time.sleep(0.3)  # the waiter is inside maru_slots_acquire now
    t0 = time.monotonic()
    h.close()
    took = time.monotonic() - t0
    t.join(timeout=10)
    assert not t.is_alive()
    assert isinstance(outcome[0], ClosedError), outcome
    assert outcome[0].code == maru.Status.CLOSED
    assert took < 2.0, f"close took {took:.2f} s with a thread waiting for a slot"
    assert outcome[1] < 2.5, f"the waiter returned after {outcome[1]:.2f} s"
    assert h.closed and all(s.released for s in held)


def test_close_waits_a_bounded_time_for_a_call_in_python(config, ns):
    # A call still inside Python code (here: between its libmaru calls) when libmaru
    # has shut down is waited for at most the handler's timeout_ms; close then
    # returns, and the handle is freed by the call itself when it leaves, so it never
    # uses a freed handler.
    h = Handler(config("cxl", f"bounded-{ns}", namespace=ns, timeout_ms=500))
    inside = threading.Event()
    leave = threading.Event()
    errors: List[BaseException] = []

    def stuck() -> None:
        try:
            with h._use() as c:
                inside.set()
                leave.wait(timeout=20)
                # libmaru answers CLOSED after the shutdown, not a use after free.
                try:
                    maru._capi.chunk_size(c)
                    errors.append(AssertionError("a call after close answered OK"))
                except ClosedError:
                    pass
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=stuck)
    t.start()
    assert inside.wait(timeout=10)
    t0 = time.monotonic()
    h.close()
    took = time.monotonic() - t0
    assert 0.4 < took < 3.0, f"close took {took:.2f} s with timeout_ms 500"
    assert h.closed
    with pytest.raises(ClosedError):
        h.store("k", b"v")
    leave.set()
    t.join(timeout=10)
    assert not t.is_alive() and errors == []
    assert h._h is None  # freed by the call that left last


def test_stats_count_hits(config, ns):
    with Handler(config("remote_cxl", f"s-{ns}", namespace=ns)) as h:
        h.store(f"{ns}-1", b"x" * 100)
        assert h.retrieve(f"{ns}-1") == b"x" * 100
        s = h.stats()
        assert isinstance(s, dict) and s["total"]["hits"] >= 1

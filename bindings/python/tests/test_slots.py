"""The staging-slot API (sync and async), views after release, and the memory hook,
against the real daemons of conftest.py on both backends."""

from __future__ import annotations

import gc
import time
from typing import Any

import pytest

import maru
from maru import BusyError, Handler, NoSpaceError, Op, Slot, SlotPool, SlotReleasedError

from conftest import BACKENDS, CHUNK_SIZE, engines, errors_of_threads, pattern
from conftest import check_a_slice_keeps, check_close_releases, check_numpy_keeps


def payload(i: int, n: int = 20_000) -> bytes:
    return pattern(str(i), n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_and_load_through_slots(backend, config, ns):
    with engines(config, backend, ns, "w", "r") as (w, r):
        keys = [f"{ns}-{i}" for i in range(4)]
        slots = w.acquire_slots(SlotPool.STORE, 4)
        assert 1 <= len(slots) <= 4 and all(isinstance(s, Slot) for s in slots)
        slots += w.acquire_slots(SlotPool.STORE, 4 - len(slots)) if len(slots) < 4 else []
        for i, s in enumerate(slots):
            assert s.capacity == CHUNK_SIZE and s.pool is SlotPool.STORE
            v = s.view
            assert isinstance(v, memoryview) and not v.readonly and v.nbytes == CHUNK_SIZE
            if i % 2:
                v[: len(payload(i))] = payload(i)  # fill in place
                s.length = len(payload(i))
            else:
                assert s.write(payload(i)) == len(payload(i))
        assert w.store_slots(keys, slots, route_key=keys[0]) == [True] * 4
        assert all(not s.released for s in slots)  # still ours after a store
        w.release_slots(slots)
        assert all(s.released for s in slots)

        loads = r.acquire_slots(SlotPool.LOAD, 5)
        missing = f"{ns}-missing"
        lens = r.load_slots(keys[: len(loads) - 1] + [missing], loads, route_key=keys[0])
        assert lens[:-1] == [len(payload(i)) for i in range(len(loads) - 1)] and lens[-1] is None
        for i, s in enumerate(loads[:-1]):
            assert s.key == keys[i] and s.length == len(payload(i))
            assert s.data().tobytes() == payload(i) == s.read()
        # A plain miss keeps its slot (maru_slots_held says it is still ours): reuse it.
        miss = loads[-1]
        assert not miss.released and miss.length is None and miss.key is None
        assert r.slots_held(loads) == [True] * len(loads) and r.slots_held([miss.id]) == [True]
        assert r.load_slots([keys[0]], [miss]) == [len(payload(0))]
        assert miss.read() == payload(0) and miss.key == keys[0]
        for s in loads:
            s.release()
        assert r.slots_held(loads) == [False] * len(loads)
        assert r.exists(keys[0]) and r.batch_exists(keys + [missing]) == [True] * 4 + [False]


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_slot_operations(backend, config, ns):
    with Handler(config(backend, f"a-{ns}", namespace=ns)) as h:
        keys = [f"{ns}-{i}" for i in range(3)]
        slots = [h.acquire_slot(SlotPool.STORE) for _ in keys]
        for i, s in enumerate(slots):
            s.write(payload(i, 1000 + i))
        op = h.submit_store_slots(keys, slots, route_key=keys[0])
        assert isinstance(op, Op)
        assert op.wait(10)
        assert op.poll() and op.done
        assert op.results() == [True] * 3
        for s in slots:
            s.release()

        with h.acquire_slots(SlotPool.LOAD, 3)[0] as a, h.acquire_slots(SlotPool.LOAD, 1)[0] as b:
            with h.submit_load_slots([keys[2], f"{ns}-missing"], [a, b], route_key=keys[0]) as op2:
                lens = op2.results(timeout=10)
            assert lens == [1002, None]
            assert a.data().tobytes() == payload(2, 1002)
            assert not b.released and b.length is None  # a plain miss keeps the slot
        assert a.released and b.released


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_busy_slot_is_refused(backend, config, ns):
    with Handler(config(backend, f"b-{ns}", namespace=ns)) as h:
        s = h.acquire_slot(SlotPool.STORE)
        s.write(b"x" * 5000)
        op = h.submit_store_slots([f"{ns}-k"], [s])
        saw_busy = False
        while not op.done:
            try:
                s.release()
            except BusyError:
                saw_busy = True
                break
        if saw_busy:  # the wrapper refused while the operation ran
            with pytest.raises(BusyError):
                s.view
        assert op.results(timeout=10) == [True]
        assert not s.released and s.read(4) == b"xxxx"
        s.release()
        with pytest.raises(maru.InvalidArgumentError, match="twice"):
            t = h.acquire_slot(SlotPool.STORE)
            try:
                h.store_slots(["a", "b"], [t, t], 1)
            finally:
                t.release()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_view_after_release_raises(backend, config, ns):
    with Handler(config(backend, f"v-{ns}", namespace=ns)) as h:
        s = h.acquire_slot(SlotPool.STORE)
        v = s.view
        d = s.data()
        v[:3] = b"abc"
        addr = s.address
        s.release()
        s.release()  # twice is harmless
        for use in (lambda: v[0], lambda: v.tobytes(), lambda: len(d), lambda: bytes(d)):
            with pytest.raises(ValueError, match="released"):
                use()
        for use in (lambda: s.view, lambda: s.data(), lambda: s.read(), lambda: s.write(b"x"), lambda: s.address):
            with pytest.raises(SlotReleasedError):
                use()
        assert isinstance(SlotReleasedError("m"), ValueError)
        # The same memory comes back in another slot: the old view shows none of it.
        again = [h.acquire_slot(SlotPool.STORE) for _ in range(8)]
        assert any(t.address == addr for t in again) and all(t.id != s.id for t in again)
        for t in again:
            t.release()

        # A slice made from the view keeps the slot: release refuses, the slot stays valid.
        s2 = h.acquire_slot(SlotPool.STORE)

        def still_valid(part: memoryview) -> None:
            s2.view[10:12] = b"ok"
            assert part[:2].tobytes() == b"ok"

        check_a_slice_keeps(s2, still_valid)


def test_numpy_over_a_slot_blocks_release_and_close(config, ns):
    h = Handler(config("cxl", f"np-{ns}", namespace=ns))
    s = h.acquire_slot(SlotPool.STORE)

    def write_through(arr: Any) -> None:
        arr[:4] = [1, 2, 3, 4]
        assert s.read(4) == b"\x01\x02\x03\x04"

    check_numpy_keeps(h, s, "still have views in use", write_through)


def test_slots_run_out_and_come_back(config, ns):
    with Handler(config("remote_cxl", f"n-{ns}", namespace=ns, load_slots=2)) as h:
        held = h.acquire_slots(SlotPool.LOAD, 5)
        assert len(held) == 2
        with pytest.raises(NoSpaceError, match="load"):
            h.acquire_slots(SlotPool.LOAD, 1, timeout=0.05)
        held[0].release()
        again = h.acquire_slot(SlotPool.LOAD, timeout=1)
        assert again.id not in {s.id for s in held}  # ids are never reused
        # A slot dropped without release goes back too.
        del again
        gc.collect()
        assert len(h.acquire_slots(SlotPool.LOAD, 2, timeout=1)) >= 1
        with pytest.raises(ValueError):
            h.acquire_slots(SlotPool.LOAD, 0)


def test_slots_of_a_closed_handler(config, ns):
    h = Handler(config("remote_cxl", f"c-{ns}", namespace=ns))
    s = h.acquire_slot(SlotPool.STORE)
    check_close_releases(h, s, s.view, [lambda: h.acquire_slot(SlotPool.STORE)])


def test_memory_hook_callbacks(config, ns):
    calls = []

    def register(ptr: int, length: int) -> int:
        calls.append(("register", ptr, length))
        return 0

    def unregister(ptr: int, length: int) -> None:
        calls.append(("unregister", ptr, length))

    try:
        maru.set_memory_hook(register, unregister)
        with Handler(config("remote_cxl", f"hook-{ns}", namespace=ns)) as h:
            s = h.acquire_slot(SlotPool.LOAD)
            assert calls and calls[0][0] == "register"
            _, ptr, length = calls[0]
            assert length >= CHUNK_SIZE * 16 and ptr <= s.address < ptr + length
            s.release()
        assert calls[-1] == ("unregister", ptr, length)
        # A register that fails fails the open, as a configuration error.
        maru.set_memory_hook(lambda p, n: 1)
        with pytest.raises(maru.ConfigError):
            Handler(config("remote_cxl", f"hook2-{ns}", namespace=ns))
        maru.set_memory_hook_auto()  # no CUDA here: handlers work with pageable memory
        with Handler(config("cxl", f"hook3-{ns}", namespace=ns)) as h:
            assert h.store(f"{ns}-k", b"v")
    finally:
        maru.set_memory_hook(None)
    n = len(calls)
    with Handler(config("cxl", f"hook4-{ns}", namespace=ns)):
        pass
    assert len(calls) == n  # removed


def test_pending_is_not_an_error():
    from maru.errors import Status, error_for, is_error

    assert Status.PENDING == 16 and not is_error(16) and not is_error(0) and is_error(12)
    with pytest.raises(ValueError):
        error_for(16, "pending")
    assert type(error_for(12, "busy")) is BusyError


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropped_operations_and_threads(backend, config, ns):
    with Handler(config(backend, f"t-{ns}", namespace=ns)) as h:
        s = h.acquire_slot(SlotPool.STORE)
        s.write(b"d" * 300)
        h.submit_store_slots([f"{ns}-dropped"], [s])  # the Op is dropped at once
        del s
        gc.collect()

        def worker(t: int) -> None:
            for i in range(15):
                k = f"{ns}-{t}-{i}"
                with h.acquire_slot(SlotPool.STORE, timeout=5) as st:
                    st.write(payload(t * 100 + i, 3000))
                    assert h.store_slots([k], [st]) == [True]
                ld = h.acquire_slot(SlotPool.LOAD, timeout=5)
                assert h.load_slots([k], [ld]) == [3000]
                assert ld.read() == payload(t * 100 + i, 3000)  # never another key's bytes
                ld.release()

        assert errors_of_threads(worker) == []
        for _ in range(50):
            if h.exists(f"{ns}-dropped"):
                break
            time.sleep(0.05)
        assert h.exists(f"{ns}-dropped")

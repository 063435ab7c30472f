"""Removing keys (maru_remove_batch), slot ownership after a miss (maru_slots_held) and
in-place views on cxl (maru_views_acquire/release), against the real daemons of
conftest.py."""

from __future__ import annotations

import ctypes
import time
from typing import Any

import pytest

import maru
from maru import Handler, RemoveResult, SlotPool, SlotReleasedError, View, ViewExpiredError

from conftest import BACKENDS, engines, errors_of_threads, pattern
from conftest import check_a_slice_keeps, check_close_releases, check_numpy_keeps


def payload(i: int, n: int = 20_000) -> bytes:
    return pattern(f"rv{i}", n)


# Remove -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_remove_own_keys(backend, config, ns):
    with engines(config, backend, ns, "w", "r") as (w, r):
        keys = [f"{ns}-{i}" for i in range(3)]
        assert w.batch_store([(k, payload(i)) for i, k in enumerate(keys)]) == [True] * 3
        assert r.retrieve(keys[0]) == payload(0)
        res = w.remove(keys[0])
        assert res is RemoveResult.REMOVED and res.removed and isinstance(res, int) and res == 0
        assert not w.exists(keys[0]) and not r.exists(keys[0]) and r.retrieve(keys[0]) is None
        assert w.remove(keys[0]) is RemoveResult.NOT_FOUND
        got = w.batch_remove([keys[1], f"{ns}-never", keys[2]], route_key=keys[0])
        assert got == [RemoveResult.REMOVED, RemoveResult.NOT_FOUND, RemoveResult.REMOVED]
        assert not any(r.batch_exists(keys))
        assert w.batch_remove([]) == []
        # The key can be stored again, with other bytes, and read back.
        assert w.store(keys[0], payload(99, 5000))
        assert r.retrieve(keys[0]) == payload(99, 5000)
        with pytest.raises(maru.InvalidArgumentError):
            w.remove("")
        with pytest.raises(TypeError):
            w.batch_remove([1])  # type: ignore[list-item]


@pytest.mark.parametrize("backend", BACKENDS)
def test_remove_of_another_engines_key_is_refused(backend, config, ns):
    with engines(config, backend, ns, "w", "o") as (w, other):
        k = f"{ns}-theirs"
        assert w.store(k, payload(1))
        assert other.remove(k) is RemoveResult.NOT_OWNER
        assert other.batch_remove([k, f"{ns}-none"]) == [RemoveResult.NOT_OWNER, RemoveResult.NOT_FOUND]
        assert other.exists(k) and other.retrieve(k) == payload(1)  # untouched
        assert w.remove(k) is RemoveResult.REMOVED


@pytest.mark.parametrize("backend", BACKENDS)
def test_pins_refuse_removal_count_and_end_with_their_handler(backend, config, ns):
    with Handler(config(backend, f"w-{ns}", namespace=ns)) as w:
        k = f"{ns}-pinned"
        assert w.store(k, payload(7))
        with Handler(config(backend, f"r-{ns}", namespace=ns)) as r:
            assert r.batch_pin([k, f"{ns}-never"]) == [True, False]
            assert r.pin(k) is True  # a second pin of the same key
            assert w.remove(k) is RemoveResult.PINNED and not RemoveResult.PINNED.removed
            assert r.unpin(k) is True
            assert w.remove(k) is RemoveResult.PINNED, "one pin left"
            assert w.unpin(k) is False, "w holds no pin of it"
            assert r.stats()  # still serving
            assert r.batch_unpin([]) == [] and r.batch_pin([]) == []
        # r closed: its remaining pin ended with it.
        assert w.remove(k) is RemoveResult.REMOVED


def test_remove_of_a_leased_key_is_refused(config, ns):
    with engines(config, "cxl", ns, "w", "r") as (w, r):
        k = f"{ns}-leased"
        assert w.store(k, payload(2))
        v = r.acquire_view(k)
        assert v is not None
        assert w.remove(k) is RemoveResult.LEASED  # a reader holds it
        assert v.read() == payload(2)  # still the key's bytes
        v.release()
        assert w.remove(k) is RemoveResult.REMOVED
        # The owner's own view leases it too.
        assert w.store(k, payload(3))
        with w.acquire_view(k) as mine:
            assert w.remove(k) is RemoveResult.LEASED
            assert mine.view.tobytes() == payload(3)
        assert w.remove(k) is RemoveResult.REMOVED
        # A view dropped without release ends its lease the moment it is freed: no
        # collection, no later call of the reader needed.
        assert w.store(k, payload(4))
        dropped = r.acquire_view(k)
        assert w.remove(k) is RemoveResult.LEASED
        del dropped
        assert w.remove(k) is RemoveResult.REMOVED
        # A memoryview of it outlives the View object: the lease lasts while it does.
        assert w.store(k, payload(5))
        mv = r.acquire_view(k).view
        assert w.remove(k) is RemoveResult.LEASED and mv.tobytes() == payload(5)
        del mv
        assert w.remove(k) is RemoveResult.REMOVED


# Slots after a miss -------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_slots_are_kept_after_a_miss(backend, config, ns):
    with Handler(config(backend, f"m-{ns}", namespace=ns, load_slots=2)) as h:
        k = f"{ns}-k"
        assert h.store(k, payload(5, 3000))
        slots = h.acquire_slots(SlotPool.LOAD, 2)
        assert len(slots) == 2
        # Misses only: both slots stay ours, usable at once.
        assert h.load_slots([f"{ns}-x", f"{ns}-y"], slots) == [None, None]
        assert not any(s.released for s in slots) and h.slots_held(slots) == [True, True]
        assert all(s.length is None and s.key is None for s in slots)
        slots[0].view  # still accessible
        # Async miss too.
        with h.submit_load_slots([f"{ns}-z"], [slots[1]]) as op:
            assert op.results(timeout=10) == [None]
        assert not slots[1].released
        # The same slots load a hit afterwards; no new slot was needed (only 2 exist).
        assert h.load_slots([k, f"{ns}-x"], slots) == [3000, None]
        assert slots[0].read() == payload(5, 3000) and slots[0].key == k
        ids = [s.id for s in slots]
        h.release_slots(slots)
        assert h.slots_held(ids) == [False, False] and h.slots_held([]) == []
        with pytest.raises(TypeError):
            h.slots_held(["x"])  # type: ignore[list-item]
        # A skipped store keeps its slot too (here: nothing skips, so check a stored one stays).
        st = h.acquire_slot(SlotPool.STORE)
        st.write(b"s" * 100)
        assert h.store_slots([f"{ns}-s"], [st]) == [True] and h.slots_held([st]) == [True]
        st.release()


# Views (cxl) --------------------------------------------------------------------------


def test_views_read_in_place(config, ns):
    with engines(config, "cxl", ns, "w", "r") as (w, r):
        keys = [f"{ns}-{i}" for i in range(3)]
        assert w.batch_store([(k, payload(i, 1000 * (i + 1))) for i, k in enumerate(keys)]) == [True] * 3
        views = r.acquire_views(keys + [f"{ns}-miss"])
        assert views[-1] is None and all(isinstance(v, View) for v in views[:-1])
        for i, v in enumerate(views[:-1]):
            assert v.key == keys[i] and v.length == len(v) == 1000 * (i + 1) and v.valid_ms > 0
            mv = v.view
            assert isinstance(mv, memoryview) and mv.readonly and mv.nbytes == v.length
            assert mv is v.view  # the same object on every access
            assert mv.tobytes() == payload(i, v.length) == v.read() == bytes(v.data())
            assert 0 < v.expires_in() <= v.valid_ms / 1000 and not v.expired and not v.released
            with pytest.raises(TypeError):
                mv[0] = 1  # read-only: the mapping is never written through a view
            assert v.address != 0
        assert len(r.held_views()) == 3
        s = r.stats()["total"]
        assert s["hits"] >= 3 and s["misses"] >= 1
        r.release_views(views)
        assert r.held_views() == [] and all(v.released for v in views[:-1])
        assert r.acquire_views([]) == [] and r.acquire_view(f"{ns}-miss") is None


def test_spans_read_in_place_and_their_leases_end_on_release(config, ns):
    """acquire_spans: the leases of views without View objects (the vLLM connector's
    loads): each found chunk's (id, address, length) over its stored bytes, None for a
    miss; a span holds its lease (the key cannot be removed) until release_spans."""
    with Handler(config("cxl", f"s-{ns}", namespace=ns)) as h:
        keys = [f"{ns}-s{i}" for i in range(3)]
        assert h.batch_store([(k, payload(i, 3000 + i)) for i, k in enumerate(keys)]) == [True] * 3
        spans = h.acquire_spans(keys + [f"{ns}-miss"])
        assert spans[-1] is None and len({s[0] for s in spans[:-1]}) == 3
        for i, (_, addr, n) in enumerate(spans[:-1]):
            assert n == 3000 + i and ctypes.string_at(addr, n) == payload(i, n)
        assert h.remove(keys[0]) is RemoveResult.LEASED
        h.release_spans([s[0] for s in spans if s is not None])
        assert h.remove(keys[0]) is RemoveResult.REMOVED
        assert h.acquire_spans([]) == [] and h.held_views() == []
        h.release_spans([])


def test_a_view_after_release_raises(config, ns):
    with Handler(config("cxl", f"v-{ns}", namespace=ns)) as h:
        k = f"{ns}-k"
        assert h.store(k, payload(7))
        with h.acquire_view(k) as v:
            mv, d = v.view, v.data()
            assert mv[:4] == payload(7)[:4]
        assert v.released and not v.expired
        for use in (lambda: mv[0], lambda: mv.tobytes(), lambda: bytes(d), lambda: len(d)):
            with pytest.raises(ValueError, match="released"):
                use()
        for use in (lambda: v.view, lambda: v.data(), lambda: v.read(), lambda: v.address):
            with pytest.raises(SlotReleasedError, match="released"):
                use()
        v.release()  # twice is harmless
        assert h.remove(k) is RemoveResult.REMOVED  # the lease went with the release

        # A slice keeps the view: release refuses, the view stays valid.
        assert h.store(k, payload(8))
        v2 = h.acquire_view(k)

        def still_valid(part: memoryview) -> None:
            assert part.tobytes() == payload(8)[10:20]

        check_a_slice_keeps(v2, still_valid)


def test_numpy_over_a_view_blocks_release_and_close(config, ns):
    h = Handler(config("cxl", f"np-{ns}", namespace=ns))
    k = f"{ns}-k"
    assert h.store(k, payload(9, 4096))
    v = h.acquire_view(k)

    def read_only_and_exact(arr: Any) -> None:
        assert not arr.flags.writeable and arr.tobytes() == payload(9, 4096)

    check_numpy_keeps(h, v, "views .* still have views in use", read_only_and_exact)


def test_a_view_expires_with_its_lease(config, ns):
    with Handler(config("cxl", f"e-{ns}", namespace=ns)) as h:
        k = f"{ns}-k"
        assert h.store(k, payload(10))
        v = h.acquire_view(k)
        mv = v.view
        # Pretend the lease is about to end (maru-server's is 60 s): the expiry thread
        # revokes the memoryview on time, without any access.
        v._deadline = time.monotonic() + 0.2
        h._expirer.add([v])
        deadline = time.monotonic() + 5
        while v._state == "held" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert v._state == "expired" and v.expired and v.released and v.expires_in() == 0
        with pytest.raises(ValueError, match="released"):
            mv[0]
        with pytest.raises(ViewExpiredError, match="expired"):
            v.view
        assert isinstance(ViewExpiredError("x"), SlotReleasedError)
        # The binding ends it in libmaru too: the expiry thread marks the view expired,
        # then gives the C view (and its lease) back, so the lease is gone moments
        # later, long before maru-server's 60 s would end it.
        deadline = time.monotonic() + 5
        while (got := h.remove(k)) is RemoveResult.LEASED and time.monotonic() < deadline:
            time.sleep(0.02)
        assert got is RemoveResult.REMOVED
        v.release()  # harmless after expiry

        # An access past the deadline notices by itself too.
        assert h.store(k, payload(11))
        v2 = h.acquire_view(k)
        v2._deadline = time.monotonic() - 1
        with pytest.raises(ViewExpiredError):
            v2.read()
        assert h.held_views() == []


def test_views_are_refused_on_remote_cxl(config, ns):
    with Handler(config("remote_cxl", f"rc-{ns}", namespace=ns)) as h:
        assert h.store(f"{ns}-k", b"v")
        with pytest.raises(maru.InvalidArgumentError, match="maru_load_slots"):
            h.acquire_views([f"{ns}-k"])
        with pytest.raises(maru.InvalidArgumentError, match="cxl"):
            h.acquire_view(f"{ns}-k")


def test_views_of_a_closed_handler(config, ns):
    h = Handler(config("cxl", f"c-{ns}", namespace=ns))
    assert h.store(f"{ns}-k", b"abc")
    v = h.acquire_view(f"{ns}-k")
    refused = [lambda: h.acquire_views([f"{ns}-k"]), lambda: h.remove(f"{ns}-k")]
    check_close_releases(h, v, v.view, refused)


def test_views_from_several_threads(config, ns):
    with Handler(config("cxl", f"t-{ns}", namespace=ns)) as h:

        def worker(t: int) -> None:
            for i in range(20):
                k = f"{ns}-{t}-{i}"
                assert h.store(k, payload(t * 100 + i, 2000))
                with h.acquire_view(k) as v:
                    assert v.view.tobytes() == payload(t * 100 + i, 2000)
                if i % 2:
                    assert h.remove(k) is RemoveResult.REMOVED

        assert errors_of_threads(worker) == [] and h.held_views() == []

"""What issue 35 asked of the upstream-compatible layer, one test each, against the
daemons of conftest.py: a chunk size that does not divide the server's pages is refused
at connect, a dropped view gives its lease or slot back at once, upstream's
environment spellings and stats fields, the backend from the environment, batched
alloc."""

from __future__ import annotations

import logging
import uuid

import pytest

import maru
from maru import compat
from maru.compat import MaruConfig, MaruHandler

from conftest import CHUNK_SIZE, compat_handlers

BACKENDS = ["cxl", "remote_cxl"]


def data(seed: int, n: int) -> bytes:
    return bytes((i * 7 + seed) & 0xFF for i in range(n))


@pytest.fixture
def ns() -> str:
    return f"points-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("chunk", [CHUNK_SIZE * 3 // 4, CHUNK_SIZE + 4096])
def test_connect_refuses_a_chunk_size_that_does_not_divide_the_page(chunk, compat_config, ns, caplog):
    h = MaruHandler(compat_config("cxl", cache_namespace=ns, chunk_size_bytes=chunk))
    with caplog.at_level(logging.ERROR, logger="maru.compat"):
        assert h.connect() is False
    msg = str(h.last_error)
    assert str(chunk) in msg and str(CHUNK_SIZE) in msg and "--chunk-size" in msg
    assert str(chunk) in caplog.text


def test_a_chunk_size_dividing_the_page_connects_and_lays_chunks_out_by_page(compat_config, ns, caplog):
    small = CHUNK_SIZE // 4
    with caplog.at_level(logging.WARNING, logger="maru.compat"):
        w = MaruHandler(compat_config("cxl", cache_namespace=ns, chunk_size_bytes=small))
        assert w.connect()
    assert "takes a whole page" in caplog.text
    try:
        handles = w.batched_alloc([small] * 3)
        for i, a in enumerate(handles):
            assert w.get_region_page_size(a.region_id) == CHUNK_SIZE
            # The page as an adapter that keeps a buffer per page reaches it: at
            # page_index x the page size, not x chunk_size_bytes.
            w.get_buffer_view(a.region_id, a.page_index * CHUNK_SIZE, small)[:] = data(i, small)
        assert w.batch_store([f"{ns}-{i}" for i in range(3)], handles) == [True] * 3
        with MaruHandler(compat_config("cxl", cache_namespace=ns, chunk_size_bytes=small)) as r:
            for i in range(3):
                info = r.retrieve(f"{ns}-{i}")
                assert info.view.tobytes() == data(i, small)
                part = r.get_by_location(info.region_id, info.page_index, small)
                assert part.tobytes() == data(i, small)
    finally:
        w.close()


def test_a_dropped_view_gives_its_lease_back_at_once(compat_config, ns):
    np = pytest.importorskip("numpy")
    with compat_handlers(compat_config, "cxl", ns) as (w, r):
        k = f"{ns}-lease"
        assert w.store(k, data(1, 5000))
        info = r.retrieve(k)
        assert w.delete(k) is False, "a reader's view holds a lease"
        del info  # no release(), no gc.collect(), no later call of the reader
        assert w.delete(k) is True
        # An array made from the view holds it as long as the array lives, and no longer.
        assert w.store(k, data(2, 5000))
        arr = np.frombuffer(r.retrieve(k).view, dtype=np.uint8)  # the MemoryInfo is dropped here
        assert w.delete(k) is False and arr.tobytes() == data(2, 5000)
        sl = arr[10:20]
        del arr
        assert w.delete(k) is False, "a slice of it still reaches the chunk"
        del sl
        assert w.delete(k) is True
        assert r.native.held_in_libmaru() == {"slots": 0, "views": 0}


def test_a_dropped_view_gives_its_load_slot_back_at_once(compat_config, ns):
    with MaruHandler(compat_config("remote_cxl", cache_namespace=ns, load_slots=3)) as h:
        keys = [f"{ns}-{i}" for i in range(2)]
        assert h.batch_store(keys, [data(i, 3000) for i in range(2)]) == [True, True]

        def free() -> int:
            return h.native.stats()["staging"]["free_load_slots"]

        infos = h.batch_retrieve(keys)
        assert free() == 1
        del infos
        assert free() == 3 and h.native.held_in_libmaru() == {"slots": 0, "views": 0}


@pytest.mark.parametrize("var, field", [("MARU_STAT", "enable_stats"), ("MARU_EAGER_MAP", "eager_map")])
def test_an_upstream_environment_switch_overrides_its_field_and_rejects_other_values(monkeypatch, var, field):
    """As upstream: MARU_STAT overrides enable_stats, MARU_EAGER_MAP eager_map; a value
    other than a boolean's is an error naming the variable; unset, the field holds."""
    monkeypatch.setenv(var, "1")
    assert getattr(MaruConfig(**{field: False}), field) is True
    monkeypatch.setenv(var, "0")
    assert getattr(MaruConfig(**{field: True}), field) is False
    monkeypatch.setenv(var, "maybe")
    with pytest.raises(ValueError, match=var):
        MaruConfig()
    monkeypatch.delenv(var)
    assert getattr(MaruConfig(**{field: False}), field) is False
    assert getattr(MaruConfig(**{field: True}), field) is True


def test_the_backend_and_agent_key_come_from_the_environment_when_not_given(monkeypatch):
    monkeypatch.setenv("MARU_STORAGE_BACKEND", "remote_cxl")
    monkeypatch.setenv("MARU_AGENT_KEY_FILE", "/etc/maru/k")
    c = MaruConfig()
    assert c.backend == "remote_cxl" and c.to_libmaru()["agent_key_file"] == "/etc/maru/k"
    # Given ones win (a config dict's backend key, SGLang's maru_storage_backend).
    assert MaruConfig(storage_backend="cxl").backend == "cxl"
    assert MaruConfig(backend="cxl").backend == "cxl"
    assert MaruConfig(agent_key_file="/mine").agent_key_file == "/mine"
    monkeypatch.setenv("MARU_STORAGE_BACKEND", "cpu")
    with pytest.raises(ValueError, match="not offered"):
        MaruConfig()


def test_maru_handler_is_upstreams_class_and_handler_the_native_one():
    assert maru.MaruHandler is compat.MaruHandler and maru.MaruConfig is compat.MaruConfig
    h = maru.MaruHandler(maru.MaruConfig(server_url="tcp://127.0.0.1:1", auto_connect=False))
    assert type(h) is compat.MaruHandler
    with pytest.raises(TypeError, match="maru.Handler"):
        maru.MaruHandler({"backend": "cxl", "server_url": "127.0.0.1:1", "engine_id": "e"})
    assert maru.Handler is maru.handler.MaruHandler and maru.Handler.__new__ is object.__new__


def test_stats_have_upstreams_fields(compat_config, ns):
    with MaruHandler(compat_config("cxl", cache_namespace=ns)) as h:
        keys = [f"{ns}-s{i}" for i in range(3)]
        assert h.batch_store(keys, [data(i, 1000) for i in range(3)]) == [True] * 3
        s = h.get_stats()
        assert s["kv_manager"]["total_entries"] == 3 and s["kv_manager"]["total_size"] == 3000
        assert s["allocation_manager"]["num_allocations"] >= 1
        pages = s["allocator"]["page_count"]
        assert pages == s["allocation_manager"]["num_allocations"] * (8 << 20) // CHUNK_SIZE
        assert s["allocator"]["free_pages"] == pages - 3
        a = h.alloc(10)
        assert h.get_stats()["allocator"]["free_pages"] == pages - 4
        h.free(a)
        assert h.delete(keys[0])
        s = h.get_stats()
        assert s["kv_manager"]["total_entries"] == 2 and s["allocator"]["free_pages"] == pages - 2
    with MaruHandler(compat_config("remote_cxl", cache_namespace=ns)) as h:
        s = h.get_stats()["allocator"]
        assert (s["page_count"], s["free_pages"]) == (8, 8)  # the store staging slots
        a = h.alloc(10)
        assert h.get_stats()["allocator"]["free_pages"] == 7
        h.free(a)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_alloc_is_all_or_none(backend, compat_config, ns):
    with MaruHandler(compat_config(backend, cache_namespace=ns, store_slots=4, timeout_ms=300)) as h:
        got = h.batched_alloc([100] * 3)
        assert len({(a.region_id, a.page_index) for a in got}) == 3
        if backend == "remote_cxl":
            with pytest.raises(compat.PoolExhaustedError):
                h.batched_alloc([100] * 2)  # one store slot is left
            assert h.get_stats()["allocator"]["free_pages"] == 1, "the slot taken went back"
        for i, a in enumerate(got):
            a.buf[:] = data(i, 100)
        assert h.batch_store([f"{ns}-b{i}" for i in range(3)], got) == [True] * 3
        assert [h.retrieve(f"{ns}-b{i}").view.tobytes() for i in range(3)] == [data(i, 100) for i in range(3)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_staging_buffer_holds_every_slot_where_it_says(backend, config):
    """maru_staging_buffer: load slots first, then store slots, each slot at one of its
    pool's places (what the staging regions of the compatible handler are built on)."""
    with maru.Handler(config(backend, f"stg-{uuid.uuid4().hex[:6]}", load_slots=3, store_slots=2)) as h:
        st = h.staging_buffer()
        size = st["slot_size"]
        assert (st["load_slots"], st["store_slots"]) == (3, 2) and st["len"] == 5 * size
        assert size >= h.chunk_size()
        loads = h.acquire_slots(maru.SlotPool.LOAD, 3)
        stores = h.acquire_slots(maru.SlotPool.STORE, 2)
        at = sorted((s.address - st["addr"]) // size for s in loads)
        assert at == [0, 1, 2] and all((s.address - st["addr"]) % size == 0 for s in loads + stores)
        assert sorted((s.address - st["addr"]) // size for s in stores) == [3, 4]
        view = h.staging_view()
        assert len(view) == st["len"] and h.staging_view() is view
        stores[0].write(b"written in the slot")
        at = stores[0].address - st["addr"]
        assert view[at : at + 19].tobytes() == b"written in the slot"
        for s in loads + stores:
            s.release()

"""What upstream Maru's adapters (LMCache's ``CxlMemoryAdapter``, SGLang's
``MaruStorage`` / ``MaruHostTensorAllocator``) ask of the handler, in this project's
own words, against the daemons of conftest.py."""

from __future__ import annotations

import ctypes
import logging
import uuid

import pytest

import maru
from maru.compat import AllocHandle, MaruConfig, MaruHandler, MemoryInfo

from conftest import CHUNK_SIZE


def data(seed: int, n: int) -> bytes:
    return bytes((i * 31 + seed) & 0xFF for i in range(n))


@pytest.fixture
def ns() -> str:
    return f"adapters-{uuid.uuid4().hex[:8]}"


def test_alloc_on_cxl_hands_out_the_page_itself_and_store_only_publishes_it(compat_config, ns):
    with MaruHandler(compat_config("cxl", cache_namespace=ns)) as w:
        a = w.alloc(1000)
        region, page = a.region_id, a.page_index
        a.buf[:] = data(1, 1000)
        # The bytes are already in the region, at the page, before store.
        seen = w.get_buffer_view(region, page * CHUNK_SIZE, 1000)
        assert seen is not None and seen.tobytes() == data(1, 1000)
        assert w.store(f"{ns}-k", a) is True
        assert w.get_stats()["compat"]["pages_taken_in_place"] == 0
        # Read back by its writer (an own region, read through its read-only mapping).
        own = w.retrieve(f"{ns}-k")
        assert (own.region_id, own.page_index) == (region, page) and own.view.tobytes() == data(1, 1000)
        own.release()
        with MaruHandler(compat_config("cxl", cache_namespace=ns)) as r:
            info = r.retrieve(f"{ns}-k")
            assert info is not None and info.view.tobytes() == data(1, 1000)
            # The reader's view names the writer's page.
            assert (info.region_id, info.page_index) == (region, page)
            info.release()


def test_lmcache_adapter_sequence(compat_config, ns):
    """Region-added callback (existing regions at registration), per-page buffers from
    get_buffer_view, alloc → write into the pre-built page buffer → store by a
    keyword-built AllocHandle; free by one; a reader finds the page by location."""
    with MaruHandler(compat_config("cxl", cache_namespace=ns)) as w:
        first = w.alloc(10)  # the first store takes the engine's first region
        w.free(first)
        pool = {}

        def on_region_added(region_id: int, page_count: int) -> None:
            views = [w.get_buffer_view(region_id, p * CHUNK_SIZE, CHUNK_SIZE) for p in range(page_count)]
            assert all(v is not None and not v.readonly for v in views)
            pool[region_id] = views

        w.set_on_region_added(on_region_added)
        assert set(pool) == set(w.get_owned_region_ids()) and pool, "existing regions are replayed at registration"
        assert len(pool[next(iter(pool))]) == w.get_region_page_count(next(iter(pool)))

        keys = [f"{ns}-{i}" for i in range(3)]
        for i, k in enumerate(keys):
            h = w.alloc(CHUNK_SIZE)
            buf = pool[h.region_id][h.page_index]
            buf[:] = data(i, CHUNK_SIZE)  # the engine's GPU → CXL copy
            store_handle = AllocHandle(buf=memoryview(b""), _region_id=h.region_id, _page_index=h.page_index, _size=CHUNK_SIZE)
            assert w.store(k, store_handle) is True
        # free by a keyword-built handle gives the page back (it is taken again later).
        h = w.alloc(5)
        w.free(AllocHandle(buf=memoryview(b""), _region_id=h.region_id, _page_index=h.page_index, _size=0))
        with pytest.raises(ValueError):
            w.free(AllocHandle(buf=memoryview(b""), _region_id=h.region_id, _page_index=h.page_index, _size=0))
        s = w.get_stats()
        assert {"kv_manager", "allocation_manager", "allocator"} <= set(s)
        assert s["kv_manager"]["stored"] >= 3 and s["allocator"]["page_size"] == CHUNK_SIZE

        with MaruHandler(compat_config("cxl", cache_namespace=ns)) as r:
            added = []
            r.set_on_region_added(lambda rid, n: added.append(rid))
            info = r.retrieve(keys[1])
            assert info is not None
            # Another engine's region, mapped by the retrieve: announced, read-only view.
            assert info.region_id in added
            n = r.get_region_page_count(info.region_id)
            assert n is not None and info.page_index < n
            v = r.get_buffer_view(info.region_id, info.page_index * CHUNK_SIZE, CHUNK_SIZE)
            assert v is not None and v.readonly and v.tobytes() == data(1, CHUNK_SIZE)
            part = r.get_by_location(info.region_id, info.page_index, 100)
            assert part is not None and part.tobytes() == data(1, 100)
            assert r.get_by_location(info.region_id, n, 100) is None  # past the region
            info.release()


def test_remote_cxl_alloc_is_a_page_of_the_staging_store_region(compat_config, ns):
    """On remote_cxl alloc hands out store staging slots as pages of a region of the
    staging buffer: region_id/page_index, get_buffer_view of that page (the slot's own
    bytes), a keyword-built handle naming it stores what was written there."""
    from maru.compat import STAGING_LOAD_REGION, STAGING_STORE_REGION

    with MaruHandler(compat_config("remote_cxl", cache_namespace=ns)) as w:
        seen = {}
        w.set_on_region_added(lambda rid, n: seen.__setitem__(rid, n))
        assert seen == {STAGING_STORE_REGION: 8, STAGING_LOAD_REGION: 8}  # store_slots, load_slots
        assert w.get_owned_region_ids() == [STAGING_STORE_REGION]
        a = w.alloc(100)
        assert a.slot_id is not None and a.region_id == STAGING_STORE_REGION
        page = w.get_buffer_view(a.region_id, a.page_index * CHUNK_SIZE, 100)
        page[:] = data(3, 100)
        assert a.buf.tobytes() == data(3, 100), "the page view and the handle's buf are one slot"
        ref = AllocHandle(buf=memoryview(b""), _region_id=a.region_id, _page_index=a.page_index, _size=100)
        assert w.store(f"{ns}-r", ref) is True
        with pytest.raises(ValueError):
            a.buf  # consumed with the store
        with MaruHandler(compat_config("remote_cxl", cache_namespace=ns)) as r:
            info = r.retrieve(f"{ns}-r")
            assert info.region_id == STAGING_LOAD_REGION and info.view.tobytes() == data(3, 100)
            # The load slot it landed in, read as a page of the staging load region.
            assert r.get_by_location(info.region_id, info.page_index, 100).tobytes() == data(3, 100)
            assert r.retrieved_view(info.region_id, info.page_index) is info


def test_a_chunk_size_above_the_servers_page_fails_connect_naming_both_sizes(compat_config, ns, caplog):
    # SGLang's MaruHostTensorAllocator asks for one chunk of the whole host KV buffer.
    h = MaruHandler(compat_config("cxl", cache_namespace=ns, chunk_size_bytes=CHUNK_SIZE * 4, pool_size=1 << 30))
    with caplog.at_level(logging.ERROR):
        assert h.connect() is False
    msg = str(h.last_error)
    assert str(CHUNK_SIZE * 4) in msg and str(CHUNK_SIZE) in msg


def test_memory_info_defaults_and_module_paths():
    m = MemoryInfo(view=memoryview(b"abc"))
    assert (m.region_id, m.page_index) == (0, 0)
    from maru_common.config import MaruConfig as C
    from maru_common.logging_setup import setup_package_logging
    from maru_handler.handler import MaruHandler as H
    from maru_handler.memory.types import AllocHandle as A, MemoryInfo as M

    assert (C, H, A, M) == (MaruConfig, MaruHandler, AllocHandle, MemoryInfo)
    lg = setup_package_logging("maru_sglang_test")
    assert lg is setup_package_logging("maru_sglang_test") and len(lg.handlers) == 1




@pytest.mark.parametrize("backend", ["cxl", "remote_cxl"])
def test_sglang_batch_get_takes_addresses_of_retrieved_views(backend, compat_config, ns):
    # MaruStorage.batch_get_v1: ctypes.c_char.from_buffer(info.view), then memmove out.
    with MaruHandler(compat_config(backend, cache_namespace=ns)) as h:
        keys = [f"{ns}-{i}" for i in range(3)]
        assert h.batch_store(keys, [data(i, 3000) for i in range(3)]) == [True] * 3
        dst = (ctypes.c_char * 3000)()
        for i, info in enumerate(h.batch_retrieve(keys)):
            src = ctypes.addressof(ctypes.c_char.from_buffer(info.view))
            ctypes.memmove(dst, src, 3000)
            assert bytes(dst) == data(i, 3000)


def test_read_only_retrieved_views_on_request(compat_config, ns):
    with MaruHandler(compat_config("cxl", cache_namespace=ns, retrieve_writable=False)) as h:
        assert h.store(f"{ns}-ro", data(9, 100))
        info = h.retrieve(f"{ns}-ro")
        assert info.view.readonly
        with pytest.raises(TypeError):
            ctypes.c_char.from_buffer(info.view)

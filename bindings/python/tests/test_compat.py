"""The upstream-compatible API (maru.compat, maru_handler, maru_common) against the real
daemons of conftest.py on both backends: the upstream call sequences, and a test of
each documented difference."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid

import pytest

import maru
from maru import compat
from maru.compat import AllocHandle, MaruConfig, MaruHandler, MemoryInfo, NotConnectedError, PoolExhaustedError

from conftest import BACKENDS, CHUNK_SIZE, compat_handlers, pattern


def kv(i: int, n: int = 30_000) -> bytes:
    return pattern(f"kv{i}", n)


# Imports and configuration ------------------------------------------------------------


def test_upstream_import_paths():
    import maru_common
    import maru_handler
    import maru_handler.memory

    assert maru_handler.MaruHandler is compat.MaruHandler
    assert maru_common.MaruConfig is compat.MaruConfig is maru.MaruConfig
    assert maru_handler.memory.MemoryInfo is MemoryInfo and maru_handler.memory.AllocHandle is AllocHandle
    # `from maru import MaruConfig, MaruHandler` as upstream: the handler follows the config.
    h = maru.MaruHandler(maru.MaruConfig(server_url="tcp://127.0.0.1:1", chunk_size_bytes=4096, auto_connect=False))
    assert isinstance(h, compat.MaruHandler)
    assert isinstance(maru.MaruHandler(), compat.MaruHandler)  # upstream's MaruHandler() with defaults
    with pytest.raises(TypeError, match="MaruConfig"):
        compat.MaruHandler({"backend": "cxl"})  # type: ignore[arg-type]


def test_config_has_the_upstream_fields_and_defaults():
    c = MaruConfig()
    upstream = dict(
        server_url="tcp://localhost:5555",
        pool_size=100 * 1024 * 1024,
        chunk_size_bytes=1024 * 1024,
        auto_connect=True,
        timeout_ms=2000,
        use_async_rpc=True,
        max_inflight=64,
        eager_map=True,
        auto_expand=True,
        expand_size=None,
        rm_address="127.0.0.1:9850",
        enable_stats=False,
    )
    for name, value in upstream.items():
        assert getattr(c, name) == value, name
    uuid.UUID(c.instance_id)  # a random UUID
    assert MaruConfig().instance_id != c.instance_id
    assert c.backend == "cxl" and (c.load_slots, c.store_slots) == (32, 32)
    assert c.to_libmaru() == {
        "backend": "cxl",
        "server_url": "localhost:5555",
        "engine_id": c.instance_id,
        "load_slots": 32,
        "store_slots": 32,
        "timeout_ms": 2000,
    }
    r = MaruConfig(
        server_url="tcp://10.0.0.1:5555,10.0.0.2:5555",
        storage_backend="remote_cxl",
        engine_id="vllm-0",
        cache_namespace="llama",
        agent_key_file="/k",
        transport="soft",
        layout="bf16",
    ).to_libmaru()
    assert r["server_url"] == "10.0.0.1:5555,10.0.0.2:5555" and r["backend"] == "remote_cxl"
    assert (r["engine_id"], r["namespace"], r["agent_key_file"], r["transport"], r["layout"]) == (
        "vllm-0",
        "llama",
        "/k",
        "soft",
        "bf16",
    )
    assert {f.name for f in dataclasses.fields(MaruConfig)} >= set(upstream) | {"instance_id"}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(chunk_size_bytes=0), "chunk_size_bytes must be positive"),
        (dict(pool_size=100, chunk_size_bytes=1000), "pool_size"),
        (dict(expand_size=10), "expand_size"),
        (dict(auto_expand=False, expand_size=2 << 20), "auto_expand"),
        (dict(storage_backend="cpu"), "not offered by libmaru"),
        (dict(storage_backend="mixed"), "not offered by libmaru"),
        (dict(backend="nvme"), "backend"),
        (dict(backend="cxl", storage_backend="remote_cxl"), "disagree"),
        (dict(load_slots=0), "load_slots"),
        (dict(server_url="nowhere"), "host:port"),
    ],
)
def test_config_is_checked_as_upstream_does(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MaruConfig(**kwargs)


def test_connect_failures_return_false(compat_config, caplog):
    with caplog.at_level(logging.ERROR, logger="maru.compat"):
        h = MaruHandler(compat_config("cxl", server_url="tcp://127.0.0.1:1"))
        assert h.connect() is False and not h.connected
        assert isinstance(h.last_error, maru.UnavailableError)
        # A chunk size over maru-server's pages: refused at connect (alloc could not hold it).
        big = MaruHandler(compat_config("cxl", chunk_size_bytes=4 * CHUNK_SIZE))
        assert big.connect() is False and "chunk size" in str(big.last_error)
    assert "127.0.0.1:1" in caplog.text
    for call in (lambda: h.alloc(10), lambda: h.store("k", b"v"), lambda: h.retrieve("k"), lambda: h.exists("k")):
        with pytest.raises(RuntimeError, match="Not connected"):
            call()
    assert h.healthcheck() is False
    h.close()  # harmless
    with pytest.raises(NotConnectedError):
        h.batch_exists(["k"])


# The upstream call sequences ----------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_upstream_sequence(backend, compat_config, ns):
    cfg_w = compat_config(backend, cache_namespace=ns)
    with MaruHandler(cfg_w) as w:  # auto_connect
        assert w.connected and w.healthcheck() and w.get_chunk_size() == CHUNK_SIZE
        keys = [f"{ns}-{i}" for i in range(6)]
        # alloc, fill in place, store
        for i in range(3):
            handle = w.alloc(len(kv(i)))
            assert handle.size == len(kv(i))
            if backend == "cxl":  # a page of an own region, written in place
                assert handle.region_id >= 1 and handle.page_index >= 0 and handle.slot_id is None
            else:  # a store staging slot, named as a page of the staging store region
                assert handle.region_id == compat.STAGING_STORE_REGION and handle.slot_id is not None
                assert 0 <= handle.page_index < 8
            handle.buf[:] = kv(i)
            assert w.store(keys[i], handle) is True
        assert w.exists(keys[0]) and not w.exists(f"{ns}-never")
        # batch_store of handles and of data (MemoryInfo, bytes), mixed
        h3 = w.alloc(len(kv(3)))
        h3.buf[:] = kv(3)
        assert w.batch_store(keys[3:], [h3, MemoryInfo(view=memoryview(bytearray(kv(4)))), kv(5)]) == [True] * 3
        assert w.store(keys[0], data=b"other bytes") is True  # first writer wins
        assert w.batch_exists(keys + [f"{ns}-never"]) == [True] * 6 + [False]
        s = w.get_stats()
        assert s["total"]["stored"] >= 6 and s["compat"]["chunk_size"] == CHUNK_SIZE

    # retrieve in another handler (another instance id)
    with MaruHandler(compat_config(backend, cache_namespace=ns)) as r:
        assert r.instance_id != cfg_w.instance_id
        info = r.retrieve(keys[1])
        assert isinstance(info, MemoryInfo) and info.view.tobytes() == kv(1) and len(info.view) == len(kv(1))
        assert info.zero_copy and info.key == keys[1]
        assert r.retrieve(f"{ns}-never") is None
        got = r.batch_retrieve(keys + [f"{ns}-never"])
        assert got[-1] is None
        assert [g.view.tobytes() for g in got[:-1]] == [kv(i) for i in range(6)]
        assert r.batch_retrieve([]) == []
        # keys as ints, as the LMCache connector passes them
        assert r.store(1234567890123, b"int key") and r.exists(1234567890123) and r.exists("1234567890123")
        assert r.retrieve(1234567890123).view.tobytes() == b"int key"

    # reconnect: close, then connect the same handler again
    h = MaruHandler(compat_config(backend, cache_namespace=ns, auto_connect=False))
    with h:
        assert not h.connected  # auto_connect=False: the with block does not connect
    assert h.connect() and h.exists(keys[2])
    h.close()
    assert not h.connected
    assert h.connect() and h.retrieve(keys[2]).view.tobytes() == kv(2)
    h.close()


# Each documented difference ----------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_alloc_is_a_store_slot_consumed_by_store(backend, compat_config, ns):
    # timeout_ms bounds alloc's wait for a slot (the exhausted case waits it out) and
    # every store's round trips: 200 ms skipped the store on a loaded machine (it said
    # so: False), so the test leaves the stores a loaded machine's budget.
    with MaruHandler(compat_config(backend, cache_namespace=ns, store_slots=2, timeout_ms=2000)) as h:
        with pytest.raises(ValueError, match="exceeds chunk_size"):
            h.alloc(CHUNK_SIZE + 1)
        with pytest.raises(ValueError):
            h.alloc(0)
        a, b = h.alloc(100), h.alloc(CHUNK_SIZE)
        if backend == "cxl":  # pages of own regions, written in place
            assert (a.region_id, a.page_index) != (b.region_id, b.page_index) and a.slot_id is None
        else:
            assert a.slot_id != b.slot_id
            with pytest.raises(PoolExhaustedError, match="store staging slots") as e:
                h.alloc(10)  # only store_slots handles at once
            assert isinstance(e.value, ValueError) and isinstance(e.value, maru.NoSpaceError)
        buf = a.buf
        buf[:5] = b"hello"
        assert h.store(f"{ns}-a", a)
        with pytest.raises(ValueError, match="released"):
            buf[0]  # the handle was consumed by store
        with pytest.raises(ValueError, match="stored"):
            a.buf
        with pytest.raises(ValueError, match="already stored"):
            h.store(f"{ns}-a2", a)
        h.free(a)  # after store: a no-op (no eviction)
        assert h.exists(f"{ns}-a")
        with pytest.raises(ValueError, match="already freed"):
            h.free(a)
        h.free(b)  # before store: discards
        with pytest.raises(ValueError):
            b.buf[0]
        c = h.alloc(10)  # the slots came back
        h.free(c)
        assert h.retrieve(f"{ns}-a").view.tobytes() == b"hello" + bytes(95)


@pytest.mark.parametrize("backend", BACKENDS)
def test_retrieved_views_are_recycled(backend, compat_config, ns):
    # Room for 2 views on both: remote_cxl keeps one more load slot free for copying
    # loads; cxl's in-place views are bounded by max_views.
    limit = dict(load_slots=3) if backend == "remote_cxl" else dict(max_views=2)
    with MaruHandler(compat_config(backend, cache_namespace=ns, **limit)) as h:
        keys = [f"{ns}-{i}" for i in range(5)]
        assert h.batch_store(keys, [kv(i, 1000 + i) for i in range(5)]) == [True] * 5
        first = h.retrieve(keys[0])
        v0 = first.view
        with h.retrieve(keys[1]) as second:
            assert second.view.tobytes() == kv(1, 1001)
        assert second.released
        with pytest.raises(ValueError, match="released"):
            second.view
        # The slots are in use: later retrieves recycle the oldest view...
        third, fourth = h.retrieve(keys[2]), h.retrieve(keys[3])
        assert third.zero_copy and fourth.zero_copy
        assert first.released
        with pytest.raises(ValueError):
            v0.tobytes()  # ...which then raises rather than show another key's bytes
        with pytest.raises(maru.SlotReleasedError, match="retrieve it again"):
            first.view
        # A view something was made from is never recycled: the chunk is copied instead.
        part3 = third.view[:10]
        part4 = fourth.view[:10]
        fifth = h.retrieve(keys[4])
        assert not fifth.zero_copy and fifth.view.tobytes() == kv(4, 1004)
        # A copy names a page of no mapping, which retrieved_view finds (LMCache's adapter).
        assert fifth.region_id == compat.COPY_REGION and h.get_buffer_view(fifth.region_id, 0, 1) is None
        assert h.retrieved_view(fifth.region_id, fifth.page_index) is fifth
        assert part3.tobytes() == kv(2, 1002)[:10] and part4.tobytes() == kv(3, 1003)[:10]
        with pytest.raises(BufferError):
            third.release()
        # A batch larger than the free slots: the rest are copies.
        del part3, part4
        got = h.batch_retrieve(keys)
        assert [g.zero_copy for g in got].count(True) == 2
        assert [g.view.tobytes() for g in got] == [kv(i, 1000 + i) for i in range(5)]
        assert h.get_stats()["compat"]["retained_views"] == 2
        views = [g.view for g in got]
    # close released every view
    assert all(g.released for g in got[:2])
    with pytest.raises(ValueError):
        views[0][0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_recycling_when_disabled(backend, compat_config, ns):
    limit = dict(load_slots=2) if backend == "remote_cxl" else dict(max_views=1)
    with MaruHandler(compat_config(backend, cache_namespace=ns, retrieve_recycle=False, **limit)) as h:
        h.store(f"{ns}-x", b"x" * 10)
        a, b = h.retrieve(f"{ns}-x"), h.retrieve(f"{ns}-x")
        assert a.zero_copy and not b.zero_copy and not a.released
        a.release()
        assert h.retrieve(f"{ns}-x").zero_copy


@pytest.mark.parametrize("backend", BACKENDS)
def test_pins_keep_keys_from_delete_until_unpinned(backend, compat_config, ns, caplog):
    with compat_handlers(compat_config, backend, ns) as (w, r):
        keys = [f"{ns}-p{i}" for i in range(3)]
        assert w.batch_store(keys, [kv(i, 1000) for i in range(3)]) == [True] * 3
        assert r.pin(keys[0]) is True  # upstream PIN_KV: the key exists (and is pinned)
        assert r.pin(f"{ns}-never") is False
        with caplog.at_level(logging.WARNING, logger="maru.compat"):
            assert w.delete(keys[0]) is False
        assert "pinned" in caplog.text and w.exists(keys[0])
        assert w.unpin(keys[0]) is False  # not w's pin
        assert r.unpin(keys[0]) is True and r.unpin(keys[0]) is False
        assert w.delete(keys[0]) is True
        # BATCH_PIN_KV pins the leading hits and stops at the first miss.
        got = r.batch_pin([keys[1], f"{ns}-never", keys[2]])
        assert got == [True, False, False]
        assert w.batch_delete([keys[1], keys[2]]) == [False, True], "only the leading hit stays pinned"
        assert r.batch_unpin([keys[1], keys[2]]) == [True, False]
        assert w.delete(keys[1]) is True
        # Pins end when their handler closes.
        assert w.store(keys[2], kv(9, 1000)) and r.batch_pin([keys[2]]) == [True]
    with MaruHandler(compat_config(backend, cache_namespace=ns)) as w:
        assert w.exists(keys[2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_delete(backend, compat_config, ns, caplog):
    with compat_handlers(compat_config, backend, ns) as (w, other):
        keys = [f"{ns}-{i}" for i in range(4)]
        assert w.batch_store(keys, [kv(i, 2000) for i in range(4)]) == [True] * 4
        assert w.delete(keys[0]) is True  # upstream: DELETE_KV success
        assert not w.exists(keys[0]) and w.retrieve(keys[0]) is None and other.retrieve(keys[0]) is None
        assert w.delete(keys[0]) is False  # not stored any more
        assert w.batch_delete([keys[1], f"{ns}-never", keys[2]]) == [True, False, True]
        assert w.batch_delete([]) == []
        assert w.delete(int(1)) is False  # int keys, as LMCache passes them
        # Another engine's key: refused (libmaru removes only the caller's own keys).
        with caplog.at_level(logging.WARNING, logger="maru.compat"):
            assert other.delete(keys[3]) is False
        assert "another engine" in caplog.text and other.exists(keys[3])
        # Stored again after delete: the new bytes.
        assert w.store(keys[0], kv(50, 1500)) and other.retrieve(keys[0]).view.tobytes() == kv(50, 1500)
    with MaruHandler(compat_config(backend, cache_namespace=ns)) as h:
        h.close()
        with pytest.raises(NotConnectedError):
            h.delete("k")


def test_delete_of_a_chunk_being_read_on_cxl(compat_config, ns, caplog):
    with compat_handlers(compat_config, "cxl", ns) as (w, r):
        k = f"{ns}-read"
        assert w.store(k, kv(60, 3000))
        info = r.retrieve(k)  # an in-place view: a lease at maru-server
        with caplog.at_level(logging.WARNING, logger="maru.compat"):
            assert w.delete(k) is False  # refused while a reader holds it (upstream: while pinned)
        assert "reader holds it" in caplog.text
        assert info.view.tobytes() == kv(60, 3000)
        info.release()
        assert w.delete(k) is True
        # The deleting handler's own retrieved views of the key are released first.
        assert w.store(k, kv(61, 3000))
        mine = w.retrieve(k)
        v = mine.view
        assert w.delete(k) is True and mine.released
        with pytest.raises(ValueError):
            v.tobytes()
        with pytest.raises(maru.SlotReleasedError, match="deleted"):
            mine.view


@pytest.mark.parametrize("backend", BACKENDS)
def test_retrieve_is_in_place_on_cxl(backend, compat_config, ns):
    with MaruHandler(compat_config(backend, cache_namespace=ns)) as h:
        keys = [f"{ns}-{i}" for i in range(3)]
        assert h.batch_store(keys, [kv(i, 5000 + i) for i in range(3)]) == [True] * 3
        infos = h.batch_retrieve(keys + [f"{ns}-never"])
        assert infos[-1] is None
        for i, info in enumerate(infos[:-1]):
            assert info.zero_copy and info.view.tobytes() == kv(i, 5000 + i)
            if backend == "cxl":  # the mapped region itself (exported writable, as upstream's), under a lease
                assert info.in_place and not info.view.readonly and 0 < info.expires_in <= 60
            else:  # a load staging slot
                assert not info.in_place and info.expires_in is None
        stats = h.get_stats()["compat"]
        assert stats["retained_views"] == 3 and stats["in_place_views"] == (3 if backend == "cxl" else 0)
        if backend == "cxl":
            assert len(h.native.held_views()) == 3
            assert h.native.stats()["staging"]["free_load_slots"] == 8  # no load slot used
        for info in infos[:-1]:
            info.release()
        if backend == "cxl":
            assert h.native.held_views() == []
        with pytest.raises(ValueError, match="released"):
            infos[0].view
        if backend == "cxl":  # an in-place view ends with its lease
            info = h.retrieve(keys[0])
            v = info.view
            info._mapped._deadline = time.monotonic() - 1  # as if maru-server's lease ran out
            assert info.released and info.expires_in == 0
            with pytest.raises(maru.ViewExpiredError):
                info.view
            with pytest.raises(ValueError):
                v[0]
            assert h.native.held_views() == [] and h.delete(keys[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_with_a_view_in_use_keeps_its_memory(backend, compat_config, ns, caplog):
    np = pytest.importorskip("numpy")
    h = MaruHandler(compat_config(backend, cache_namespace=ns))
    assert h.connect()
    h.store(f"{ns}-t", kv(9, 500))
    tensor = np.frombuffer(h.retrieve(f"{ns}-t").view, dtype=np.uint8)  # torch.frombuffer in LMCache
    with caplog.at_level(logging.ERROR, logger="maru.compat"):
        h.close()  # never raises, as upstream
    assert "still have views in use" in caplog.text and not h.connected
    assert tensor.tobytes() == kv(9, 500)  # its memory is still valid
    del tensor
    h.close()  # now the libmaru handler closes
    assert not h._leftover


def test_get_stats_and_healthcheck(compat_config, ns):
    with MaruHandler(compat_config("remote_cxl", cache_namespace=ns)) as h:
        h.store(f"{ns}-s", b"s")
        h.retrieve(f"{ns}-s")
        s = h.get_stats()
        assert s["backend"] in ("remote_cxl", "remotecxl") and s["total"]["hits"] >= 1 and s["pools"][0]["up"]
        assert {"kv_manager", "allocation_manager", "allocator"} <= set(s)  # upstream's names, our figures
        assert h.healthcheck()
        assert isinstance(h.native, maru.Handler)
    assert not h.healthcheck()


def test_regions_on_remote_cxl_are_the_staging_buffers(compat_config, ns):
    # No region of the pool is mapped on a GPU node: the only regions are the staging
    # buffer's, and no real region id reaches anything.
    with MaruHandler(compat_config("remote_cxl", cache_namespace=ns)) as h:
        h.store(f"{ns}-p", b"p")
        assert h.prefetch_batch([f"{ns}-p", f"{ns}-q"]) == 1
        seen = []
        h.set_on_region_added(lambda r, n: seen.append(r))
        assert seen == [compat.STAGING_STORE_REGION, compat.STAGING_LOAD_REGION]
        assert h.get_owned_region_ids() == [compat.STAGING_STORE_REGION]
        assert h.get_buffer_view(1, 0, 10) is None and h.get_region_page_count(1) is None
        with pytest.raises(maru.UnsupportedError, match="pool_handle"):
            h.pool_handle
"""The binding against real daemons, on both backends."""

from __future__ import annotations

import hashlib
import uuid

import pytest

import maru
from maru import ClosedError, ConfigError, MaruHandler, chunk_keys

BACKENDS = ["remote_cxl", "cxl"]


def payload(i: int, n: int = 40_000) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (n // 32) + bytes([i % 256]) * (n % 32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_engines_share_chunks(backend, config):
    ns = uuid.uuid4().hex
    with MaruHandler(config(backend, f"a-{ns}", namespace=ns)) as a, MaruHandler(config(backend, f"b-{ns}", namespace=ns)) as b:
        keys = [f"{ns}-{i}" for i in range(50)]
        data = [payload(i) for i in range(50)]
        assert all(a.batch_store(list(zip(keys, data))))
        assert all(b.batch_exists(keys))
        got = b.batch_retrieve(keys)
        assert [hashlib.sha256(g).digest() for g in got] == [hashlib.sha256(d).digest() for d in data]
        assert b.stats()["total"]["hits"] >= 50


@pytest.mark.parametrize("backend", BACKENDS)
def test_buffers_in_and_out_without_copies(backend, config):
    ns = uuid.uuid4().hex
    with MaruHandler(config(backend, f"e-{ns}", namespace=ns)) as h:
        src = bytearray(payload(7))
        assert h.store(f"{ns}-ba", src)
        assert h.store(f"{ns}-mv", memoryview(src)[100:2100])
        assert h.store(f"{ns}-bytes", bytes(src))
        out = bytearray(h.chunk_size())
        n = h.retrieve_into(f"{ns}-ba", out)
        assert n == len(src) and out[:n] == src
        view = memoryview(bytearray(4096))
        assert h.retrieve_into(f"{ns}-mv", view) == 2000
        assert view[:2000].tobytes() == bytes(src[100:2100])
        assert h.retrieve(f"{ns}-bytes") == bytes(src)


def test_numpy_arrays(config):
    np = pytest.importorskip("numpy")
    ns = uuid.uuid4().hex
    with MaruHandler(config("cxl", f"np-{ns}", namespace=ns)) as h:
        arr = np.arange(4096, dtype=np.float32)
        assert h.store(f"{ns}-arr", arr)
        out = np.zeros_like(arr)
        assert h.retrieve_into(f"{ns}-arr", out) == arr.nbytes
        assert (out == arr).all()


def test_a_miss_is_none(config):
    with MaruHandler(config("remote_cxl", "miss")) as h:
        assert h.retrieve("never-stored-" + uuid.uuid4().hex) is None
        assert not h.exists("never-stored-" + uuid.uuid4().hex)


def test_a_chunk_larger_than_a_page_is_refused(config):
    with MaruHandler(config("cxl", "big")) as h:
        with pytest.raises(maru.InvalidArgumentError):
            h.store("too-big", b"x" * (h.chunk_size() + 1))


def test_bad_config_names_the_field(config):
    with pytest.raises(ConfigError) as e:
        MaruHandler(config("cxl", "x", load_slot=3))
    assert "load_slot" in str(e.value)
    with pytest.raises(ConfigError):
        MaruHandler("{not json")


def test_a_closed_handler_refuses_calls(config):
    h = MaruHandler(config("cxl", "closing"))
    h.close()
    h.close()
    with pytest.raises(ClosedError):
        h.store("k", b"v")


def test_chunk_keys_share_prefixes_within_a_namespace():
    a = chunk_keys(list(range(1000)), 256, "llama")
    b = chunk_keys(list(range(768)) + [9] * 300, 256, "llama")
    assert len(a) == 3 and len(b) == 4
    assert a[:3] == b[:3]
    assert chunk_keys(list(range(1000)), 256, "other")[0] != a[0]
    assert chunk_keys(list(range(255)), 256, "llama") == []

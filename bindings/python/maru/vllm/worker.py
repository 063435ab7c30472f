"""The vLLM connector's worker side without vLLM or torch: the KV memory of the
engine's layers (:class:`KVBlocks`, :class:`PagedKV`, :class:`LayerMemory`) and
:class:`WorkerCore`, which loads and stores the chunks the scheduler planned
(:mod:`maru.vllm.core`) through its Maru handlers. The vLLM class
(:mod:`maru.vllm.connector`) hands it plain values, so it is tested without vLLM.
"""

from __future__ import annotations

import collections
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple

from ..copies import copy_ranges
from ..errors import MaruError, NoSpaceError, UnavailableError
from ..slots import SlotPool
from .core import (
    DEFAULT_TIMEOUT_MS,
    SHUTDOWN_WAIT_S,
    VIEW_BATCH,
    ChunkTransfer,
    HandlerSlot,
    RateLimited,
    log,
)


class KVBlocks:
    """What the worker core needs from the engine's KV cache: ``chunk_bytes`` (one
    chunk, all layers) and the copies between a chunk's blocks and ``size`` bytes of
    memory at an address (a staging slot, a page of an own region, a chunk read in
    place). ``blocks`` are ``(position in the chunk, block id)``."""

    chunk_bytes: int

    def copy_out(self, blocks: Sequence[Tuple[int, int]], addr: int, size: int) -> None:
        raise NotImplementedError

    def copy_in(self, blocks: Sequence[Tuple[int, int]], addr: int, size: int) -> None:
        raise NotImplementedError

    def copy_in_many(self, chunks: Sequence[Tuple[Sequence[Tuple[int, int]], int]], size: int) -> None:
        """:meth:`copy_in` of each ``(blocks, addr)``; at once where the cache can."""
        for blocks, addr in chunks:
            self.copy_in(blocks, addr, size)

    def host_moves(self, blocks: Sequence[Tuple[int, int]]) -> Optional[List[Tuple[int, int, int]]]:
        """For a cache in host memory: ``(offset in the chunk, address in the cache,
        bytes)`` of each piece that loads a chunk into ``blocks`` (libmaru then copies
        them itself, ``Handler.load_pieces``); None for a cache it cannot address (on a
        GPU: the loads go through :meth:`copy_in_many`)."""
        return None


@dataclass(frozen=True)
class LayerMemory:
    """One KV tensor of the engine's cache, as host memory: ``num_blocks`` blocks from
    ``addr``. ``pieces`` is 1 when the block index is the tensor's first dimension
    (vLLM's CPU layout ``[num_blocks, kv_heads, block_size, 2 * head_size]``: a block is
    ``piece`` contiguous bytes), or the size of the first dimension when the block
    index is the second (``[2, num_blocks, ...]``: a block is ``piece`` bytes in each
    of the K and V halves)."""

    addr: int
    num_blocks: int
    pieces: int
    piece: int

    @property
    def block_bytes(self) -> int:
        return self.pieces * self.piece


class PagedKV(KVBlocks):
    """A KV cache in host memory (``layers``, in layer order), copied by libmaru
    (:func:`maru.copy_ranges`: streaming stores for a large batch, one fence) in one call
    per chunk stored and per batch of chunks loaded: one piece per layer and piece of a block for each run of blocks that are
    consecutive both in the chunk and in the cache (usually the whole chunk), never a
    copy per token.

    A chunk is, for each layer, for each piece, its ``blocks_per_chunk`` blocks' bytes
    one after the other."""

    def __init__(self, layers: Sequence[LayerMemory], blocks_per_chunk: int):
        if not layers:
            raise ValueError("maru.vllm: no KV cache layer")
        if blocks_per_chunk <= 0:
            raise ValueError(f"blocks_per_chunk {blocks_per_chunk} is not positive")
        self.layers = list(layers)
        self.bpc = blocks_per_chunk
        self.chunk_bytes = sum(m.block_bytes for m in self.layers) * blocks_per_chunk
        self.copies = 0  # memmove calls made (for the tests: few large copies)
        self._blocks = min(m.num_blocks for m in self.layers)
        # Per layer and piece: (its offset in a chunk, the address of its block 0, its
        # bytes per block); a move of run (pos, b, n) is (off + pos * p, at + b * p, n * p).
        self._pieces: List[Tuple[int, int, int]] = []
        off = 0
        for m in self.layers:
            for i in range(m.pieces):
                self._pieces.append((off + i * self.bpc * m.piece, m.addr + i * m.num_blocks * m.piece, m.piece))
            off += m.block_bytes * self.bpc

    def _runs(self, blocks: Sequence[Tuple[int, int]]) -> List[Tuple[int, int, int]]:
        """``(first position, first block, count)`` of each run of blocks consecutive in
        the chunk and in the cache; refuses positions or block ids out of range (a
        wrong id must never write outside the cache)."""
        runs: List[Tuple[int, int, int]] = []
        nb = self._blocks
        for pos, b in blocks:
            if not (0 <= pos < self.bpc and 0 <= b < nb):
                raise ValueError(f"block {b} at position {pos} is outside the cache ({nb} blocks, {self.bpc} a chunk)")
            if runs and runs[-1][0] + runs[-1][2] == pos and runs[-1][1] + runs[-1][2] == b:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((pos, b, 1))
        return runs

    def moves(self, blocks: Sequence[Tuple[int, int]]) -> List[Tuple[int, int, int]]:
        """``(offset in the chunk, address in the cache, bytes)`` of each copy."""
        runs = self._runs(blocks)
        if len(runs) == 1:  # the usual case: the chunk's blocks are consecutive
            pos, b, n = runs[0]
            return [(off + pos * p, at + b * p, n * p) for off, at, p in self._pieces]
        return [(off + pos * p, at + b * p, n * p) for off, at, p in self._pieces for pos, b, n in runs]

    def host_moves(self, blocks: Sequence[Tuple[int, int]]) -> Optional[List[Tuple[int, int, int]]]:
        return self.moves(blocks)

    def _check(self, size: int) -> None:
        if size != self.chunk_bytes:
            raise ValueError(f"a chunk here is {self.chunk_bytes} bytes, not {size}")

    def copy_out(self, blocks: Sequence[Tuple[int, int]], addr: int, size: int) -> None:
        """Into Maru's memory at ``addr`` (a page or a store slot, read by others)."""
        self._check(size)
        if [p for p, _ in blocks] != list(range(self.bpc)):
            raise ValueError("a stored chunk needs all its blocks")
        pieces = [(addr + off, at, n) for off, at, n in self.moves(blocks)]
        copy_ranges(pieces, into_shared=True)
        self.copies += len(pieces)

    def copy_in(self, blocks: Sequence[Tuple[int, int]], addr: int, size: int) -> None:
        self.copy_in_many([(blocks, addr)], size)

    def copy_in_many(self, chunks: Sequence[Tuple[Sequence[Tuple[int, int]], int]], size: int) -> None:
        """All the pieces of ``chunks`` in one call."""
        self._check(size)
        pieces = [(at, addr + off, n) for blocks, addr in chunks for off, at, n in self.moves(blocks)]
        copy_ranges(pieces)
        self.copies += len(pieces)


@dataclass
class WorkerStats:
    chunks_loaded: int = 0
    bytes_loaded: int = 0
    chunks_load_failed: int = 0
    load_s: float = 0.0  # time spent loading (lookups of leases, transfers, copies)
    load_best_gbs: float = 0.0  # the fastest step's loads (bytes over their time)
    load_copy_s: float = 0.0  # of load_s, the copies into the blocks (with load_pieces: its calls, leases included)
    chunks_stored: int = 0
    bytes_stored: int = 0
    chunks_store_submitted: int = 0
    chunks_store_skipped: int = 0
    chunks_store_failed: int = 0
    store_s: float = 0.0  # time the step waited for stores (copies out of the cache, submits)

    def as_dict(self) -> Dict[str, Any]:
        d = dict(self.__dict__)
        d["load_gbs"] = self.bytes_loaded / self.load_s / 1e9 if self.load_s > 0 else None
        return d


class WorkerCore:
    """The worker side of one tensor-parallel rank.

    Loads (synchronous, before the forward pass): into a cache in host memory (vLLM on
    CPU), on either backend, one libmaru call per batch of chunks (``load_pieces``)
    takes their leases and copies each chunk's pieces straight into the engine's blocks
    (on ``cxl`` from the CXL mapping, on ``remote_cxl`` from the staging buffer as each
    window of the transfer lands); libmaru gives the leases back after the call. Into a
    cache libmaru cannot address (a GPU's): on ``cxl`` each chunk is read in place
    (``acquire_spans``) and copied into the blocks; on ``remote_cxl`` the load slots are
    cut in two halves, so that one half's chunks are copied into the blocks while the
    other's transfer runs. Any
    chunk that is not loaded whole (a miss, a short chunk, an error) marks its blocks
    and those of every later chunk of the request as failed (:meth:`take_load_errors`):
    vLLM recomputes them, never uses wrong KV.

    Stores copy each completed chunk out of the blocks at once (so vLLM may reuse the
    blocks): on ``cxl`` straight into a page of an own region, published at once
    (``take_pages`` / ``publish_pages``); on ``remote_cxl`` into a store slot, submitted
    asynchronously. libmaru publishes a key only after its bytes are written. A
    request's chunks after one that found no room are skipped (without it they could
    never be found). Chunks not stored because maru-server or a pool is away, or for
    want of room, are counted and logged (rate-limited)."""

    def __init__(self, rank: int, handler: Any, kv: Optional[KVBlocks] = None,
                 clock: Callable[[], float] = time.monotonic, stats_file: Optional[str] = None,
                 in_place: bool = False, timeout_ms: Optional[int] = None):
        self.rank = rank
        self.handler = handler  # HandlerSlot
        self.kv = kv
        self.clock = clock
        self.in_place = in_place
        self.wait_s = 2 * (timeout_ms or DEFAULT_TIMEOUT_MS) / 1000 + 1
        self.stats = WorkerStats()
        self.stats_file = stats_file
        self.info: Dict[str, Any] = {}  # written with the stats (digest, chunk size, ...)
        self._errors: Set[int] = set()
        self._pending: List[Tuple[Any, List[Any]]] = []  # (Op, slots)
        self._skip = {why: RateLimited(clock=clock) for why in ("room", "away", "refused")}
        self._disabled: Optional[str] = None
        self._checked: Any = None  # the handler whose page size was checked

    def attach(self, kv: KVBlocks) -> None:
        self.kv = kv

    def disable(self, why: str) -> None:
        log.error("maru.vllm worker: connector disabled: %s", why)
        self._disabled = why

    def chunk_misfit(self, h: Any) -> Optional[str]:
        """Why chunks do not fit in ``h``'s pages (maru-server's ``--chunk-size``), or None."""
        page = h.chunk_size()
        if self.kv is not None and self.kv.chunk_bytes > page:
            return (f"a chunk is {self.kv.chunk_bytes} bytes, more than maru-server's chunk size {page} "
                    f"(--chunk-size): lower maru_chunk_tokens or raise --chunk-size")
        return None

    def _handler(self) -> Any:
        if self._disabled or self.kv is None or self.handler is None:
            return None
        h = self.handler.get()
        if h is not None and h is not self._checked:
            # Also for a handler opened late (maru-server was away at start).
            why = self.chunk_misfit(h)
            if why:
                self.disable(why)
                return None
            self._checked = h
        return h

    # Loads ----------------------------------------------------------------------

    def load(self, transfers: Sequence[ChunkTransfer]) -> None:
        step_start, step_bytes = self.clock(), self.stats.bytes_loaded
        for t in transfers:
            start = self.clock()
            failed_from = self._load_one(t)
            self.stats.load_s += self.clock() - start
            if failed_from is not None:
                lost = len(t.blocks) - failed_from
                self.stats.chunks_load_failed += lost
                self._errors |= t.block_ids_from(failed_from)
                log.warning("maru.vllm worker: request %s: %d of %d chunks not loaded (from chunk %d): recomputed",
                            t.req_id, lost, len(t.blocks), t.first_chunk + failed_from)
        if transfers:
            took = self.clock() - step_start
            if took > 0:
                rate = (self.stats.bytes_loaded - step_bytes) / took / 1e9
                self.stats.load_best_gbs = max(self.stats.load_best_gbs, rate)
            self.write_stats()

    def _load_one(self, t: ChunkTransfer) -> Optional[int]:
        """Loads ``t``'s chunks; returns the index of the first chunk not loaded, or None."""
        h = self._handler()
        if h is None:
            return 0
        try:
            if self.kv.host_moves(t.blocks[0]) is not None:
                return self._load_pieces(h, t)
            return self._load_in_place(h, t) if self.in_place else self._load_through_slots(h, t)
        except MaruError as e:
            log.warning("maru.vllm worker: load of request %s failed: %s", t.req_id, e)
            if isinstance(e, UnavailableError):
                self.handler.failed(e)
            return 0

    def _loaded(self, t: ChunkTransfer, first: int, found: Sequence[Tuple[Optional[int], int]]) -> Optional[int]:
        """Copies the leading whole chunks of ``found`` (``(length or None, address)`` of
        chunks ``first``, ``first + 1``, ...) into their blocks, in one call; returns the
        index of the first chunk not whole, or None."""
        size = self.kv.chunk_bytes
        whole = 0
        for n, _ in found:
            if n != size:
                if n is not None:
                    log.warning("maru.vllm worker: chunk %s has %d bytes, expected %d",
                                t.keys[self.rank][first + whole], n, size)
                break
            whole += 1
        if whole:
            start = self.clock()
            self.kv.copy_in_many([(t.blocks[first + j], addr) for j, (_, addr) in enumerate(found[:whole])], size)
            self.stats.load_copy_s += self.clock() - start
            self.stats.chunks_loaded += whole
            self.stats.bytes_loaded += whole * size
        return None if whole == len(found) else first + whole

    def _load_pieces(self, h: Any, t: ChunkTransfer) -> Optional[int]:
        """A cache in host memory, either backend: per batch of chunks one
        ``load_pieces`` call, the leases taken and the chunks' pieces copied straight
        into their blocks while held, inside libmaru, which gives the leases back after
        the call (the fixed cost of a load: one call, not three and the Python between
        them, and no wait for the release)."""
        keys = t.keys[self.rank]
        size = self.kv.chunk_bytes
        for i in range(0, len(keys), VIEW_BATCH):
            part = keys[i : i + VIEW_BATCH]
            pieces = [(j, off, at, n) for j in range(len(part)) for off, at, n in self.kv.host_moves(t.blocks[i + j]) or ()]
            start = self.clock()
            got = h.load_pieces(part, pieces, route_key=t.route_key)
            self.stats.load_copy_s += self.clock() - start
            whole = 0
            for copied, n in got:
                if not copied or n != size:
                    if n:
                        log.warning("maru.vllm worker: chunk %s has %d bytes, expected %d", part[whole], n, size)
                    break
                whole += 1
            self.stats.chunks_loaded += whole
            self.stats.bytes_loaded += whole * size
            if whole < len(part):
                return i + whole
        return None

    def _load_in_place(self, h: Any, t: ChunkTransfer) -> Optional[int]:
        """cxl: each chunk read in place under a lease (``acquire_spans``: the views'
        addresses, no View objects, as the bytes are copied at once), one copy into the
        blocks, then the leases given back in one call."""
        keys = t.keys[self.rank]
        for i in range(0, len(keys), VIEW_BATCH):
            spans = h.acquire_spans(keys[i : i + VIEW_BATCH], route_key=t.route_key)
            try:
                failed = self._loaded(t, i, [(None, 0) if s is None else (s[2], s[1]) for s in spans])
                if failed is not None:
                    return failed
            finally:
                try:
                    h.release_spans([s[0] for s in spans if s is not None])  # the leases in one call
                except Exception as e:  # noqa: BLE001 - released with the handler at the latest
                    log.warning("maru.vllm worker: cannot release views: %s", e)
        return None

    def _load_through_slots(self, h: Any, t: ChunkTransfer) -> Optional[int]:
        """remote_cxl, a cache libmaru cannot address: the load slots in two halves; a
        half's chunks are copied into the blocks while the other half's transfer runs,
        then it takes the next chunks."""
        keys = t.keys[self.rank]
        n = len(keys)
        try:
            slots = h.acquire_slots(SlotPool.LOAD, n, timeout=1.0)
        except MaruError as e:
            log.warning("maru.vllm worker: no load slot: %s", e)
            return 0
        half = (len(slots) + 1) // 2
        free: Deque[List[Any]] = collections.deque(g for g in (slots[:half], slots[half:]) if g)
        running: Deque[Tuple[int, Any, List[Any], int]] = collections.deque()  # (first chunk, op, slots, chunks)
        nxt, failed = 0, None
        try:
            while running or (nxt < n and failed is None):
                while free and nxt < n and failed is None:
                    group = free.popleft()
                    k = min(len(group), n - nxt)
                    op = h.submit_load_slots(keys[nxt : nxt + k], group[:k], route_key=t.route_key)
                    running.append((nxt, op, group, k))
                    nxt += k
                first, op, group, k = running.popleft()
                try:
                    lens = op.results(self.wait_s)
                finally:
                    _free_op(op)
                if failed is None:
                    failed = self._loaded(t, first, [(lens[j], group[j].address) for j in range(k)])
                free.append(group)
        finally:
            for _, op, _, _ in running:  # only after an error: let each end before its slots go
                try:
                    op.wait(self.wait_s)
                except MaruError:
                    pass
                _free_op(op)
            _release(slots)
        return failed

    def take_load_errors(self) -> Set[int]:
        out, self._errors = self._errors, set()
        return out

    # Stores ---------------------------------------------------------------------

    def store(self, transfers: Sequence[ChunkTransfer]) -> None:
        """The step's stores (``wait_for_save``); ``stats.store_s`` counts the time the
        step spends here when it has chunks to store."""
        self.poll()
        if not transfers:
            return
        start = self.clock()
        h = self._handler()
        if h is None:
            n = sum(len(t.blocks) for t in transfers)
            self.stats.chunks_store_skipped += n
            if not self._disabled:
                self._skip["away"](n, "maru.vllm worker: maru-server unreachable: %d chunks not stored", n)
        else:
            for t in transfers:
                if self.in_place:
                    self._store_in_place(h, t)
                else:
                    self._store_through_slots(h, t)
        self.stats.store_s += self.clock() - start
        self.write_stats()

    def _no_room(self, t: ChunkTransfer, n: int, what: str) -> None:
        self.stats.chunks_store_skipped += n
        self._skip["room"](n, "maru.vllm worker: no free %s: %d chunks of request %s not stored%s", what, n, t.req_id,
                           " (raise maru_store_slots)" if what == "store slot" else "")

    def _room(self, t: ChunkTransfer, take: Callable[[int], List[Any]], what: str) -> List[Any]:
        """Room for ``t``'s chunks (pages or store slots, ``take(n)`` gives up to ``n``);
        the chunks that find none are counted and logged."""
        n = len(t.blocks)
        try:
            room = take(n)
        except NoSpaceError:
            room = []
        except MaruError as e:
            self._store_failed(t, n, e)
            return []
        if len(room) < n:
            self._no_room(t, n - len(room), what)
        return room

    def _copy_out(self, t: ChunkTransfer, addrs: Sequence[int]) -> Optional[Exception]:
        """Copies ``t``'s first ``len(addrs)`` chunks out of the blocks to ``addrs``."""
        try:
            for addr, blocks in zip(addrs, t.blocks):
                self.kv.copy_out(blocks, addr, self.kv.chunk_bytes)
        except Exception as e:  # noqa: BLE001 - a failed store is a later miss, never a crash
            return e
        return None

    def _store_in_place(self, h: Any, t: ChunkTransfer) -> None:
        """cxl: each chunk copied straight into a page of an own region, then the
        request's pages published in one call."""
        keys = t.keys[self.rank]
        pages = self._room(t, lambda n: h.take_pages(n, route_key=t.route_key), "page in the pool")
        if not pages:
            return
        err = self._copy_out(t, [p.addr for p in pages])
        if err is None:
            self.stats.chunks_store_submitted += len(pages)
            try:
                ok = h.publish_pages(keys[: len(pages)], [(p.region_id, p.page) for p in pages],
                                     [self.kv.chunk_bytes] * len(pages))
            except MaruError as e:
                err = e
        if err is not None:
            self._give_back(h, pages)
            self._store_failed(t, len(pages), err)
            return
        self._stored(h, [bool(x) for x in ok])

    def _give_back(self, h: Any, pages: Sequence[Any]) -> None:
        try:
            h.give_back_pages([(p.region_id, p.page) for p in pages])
        except MaruError as e:
            log.warning("maru.vllm worker: pages not given back (the handler takes them back at close): %s", e)

    def _store_through_slots(self, h: Any, t: ChunkTransfer) -> None:
        """remote_cxl: each chunk copied into a store slot, submitted asynchronously."""
        keys = t.keys[self.rank]
        slots = self._room(t, lambda n: h.acquire_slots(SlotPool.STORE, n, timeout=0), "store slot")
        if not slots:
            return
        err = self._copy_out(t, [s.address for s in slots])
        if err is None:
            try:
                op = h.submit_store_slots(keys[: len(slots)], slots, lengths=self.kv.chunk_bytes, route_key=t.route_key)
            except MaruError as e:
                err = e
        if err is not None:
            _release(slots)
            self._store_failed(t, len(slots), err)
            return
        self.stats.chunks_store_submitted += len(slots)
        self._pending.append((op, slots))

    def _stored(self, h: Any, ok: List[bool]) -> None:
        """Counts a finished store; chunks libmaru skipped (a pool away, no room in it)
        are logged with the reason the handler's stats give."""
        n_ok = sum(1 for x in ok if x)
        self.stats.chunks_stored += n_ok
        self.stats.bytes_stored += n_ok * (self.kv.chunk_bytes if self.kv else 0)
        skipped = len(ok) - n_ok
        if not skipped:
            return
        self.stats.chunks_store_skipped += skipped
        away = pools_down(h)
        if away:
            self._skip["away"](skipped, "maru.vllm worker: %d chunks not stored: pool %s unavailable, its prefixes "
                               "miss until it is back", skipped, ", ".join(away))
        else:
            self._skip["refused"](skipped, "maru.vllm worker: %d chunks not stored (no room in the pool, or its "
                                  "region was lost meanwhile; libmaru's log says which)", skipped)

    def _store_failed(self, t: ChunkTransfer, n: int, e: Exception) -> None:
        self.stats.chunks_store_failed += n
        log.warning("maru.vllm worker: store of %d chunks of request %s failed: %s", n, t.req_id, e)
        if isinstance(e, UnavailableError):
            self.handler.failed(e)

    def poll(self, wait_s: float = 0.0) -> int:
        """Finishes the stores that are done (``wait_s``: how long to wait for the rest);
        returns how many are still in flight."""
        deadline = self.clock() + wait_s
        still: List[Tuple[Any, List[Any]]] = []
        for op, slots in self._pending:
            left = max(0.0, deadline - self.clock())
            try:
                done = op.wait(left) if left > 0 else op.poll()
            except MaruError as e:
                self.stats.chunks_store_failed += len(slots)
                log.warning("maru.vllm worker: asynchronous store failed: %s", e)
                done = True
                ok: Optional[List[bool]] = None
            else:
                ok = list(op.results(0)) if done else None
            if not done:
                still.append((op, slots))
                continue
            if ok is not None:
                self._stored(getattr(self.handler, "handler", None), ok)
            _free_op(op)
            _release(slots)
        changed = len(still) != len(self._pending)
        self._pending = still
        if changed:
            self.write_stats()
        return len(still)

    def write_stats(self) -> None:
        if not self.stats_file:
            return
        path = self.stats_file if self.rank == 0 else f"{self.stats_file}.rank{self.rank}"
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump({**self.info, **self.stats.as_dict()}, f)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("maru.vllm worker: cannot write %s: %s", path, e)

    def close(self) -> None:
        left = self.poll(SHUTDOWN_WAIT_S)
        if left:
            log.warning("maru.vllm worker: %d stores still in flight at shutdown", left)
        if self.handler is not None:
            self.handler.close()


def pools_down(h: Any) -> List[str]:
    """The pools of ``h`` that are unavailable now (from its stats), by URL."""
    try:
        return [p.get("url", "?") for p in h.stats().get("pools", []) if not p.get("up", True)]
    except Exception:  # noqa: BLE001 - only for a log line
        return []


def _free_op(op: Any) -> None:
    """Frees a finished operation; a failure is logged, never raised."""
    try:
        op.close()
    except Exception as e:  # noqa: BLE001
        log.warning("maru.vllm: cannot free %r: %s", op, e)


def _release(slots: Sequence[Any]) -> None:
    for s in slots:
        try:
            s.release()
        except Exception as e:  # noqa: BLE001 - a slot that cannot be released is logged, not fatal
            log.warning("maru.vllm: cannot release staging slot %s: %s", getattr(s, "id", "?"), e)

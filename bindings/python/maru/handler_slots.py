"""The handler's staging-slot calls (:class:`_SlotCalls`, a part of
:class:`maru.Handler`): slots acquired, stored from and loaded into, synchronously or
as an :class:`~maru.Op`, and given back; the whole staging buffer as one memoryview.
The rules the binding enforces are in :mod:`maru.slots`."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, Union

from . import _capi
from ._args import _keys, _rk
from ._book import _Views
from .errors import InvalidArgumentError, MaruError, Status
from .slots import Op, Slot, SlotPool, as_lengths

_R = TypeVar("_R")


def _store_lengths(lengths: Union[None, int, Sequence[int]], slots: List[Slot]) -> List[int]:
    """The bytes to store of each slot (:func:`~maru.slots.as_lengths`), each in
    ``1..capacity``."""
    lens_l = as_lengths(lengths, slots)
    for s, ln in zip(slots, lens_l):
        if not 1 <= ln <= s.capacity:
            raise InvalidArgumentError(Status.INVALID_ARGUMENT, f"length {ln} of slot {s.id} is not in 1..{s.capacity}")
    return lens_l


class _SlotCalls:
    """The staging-slot methods of :class:`maru.Handler` (its ``_use``, ``_slot_lock``,
    ``_slots``, ``_releases`` and ``_region_exports`` are the handler's)."""

    def acquire_slots(self, pool: Union[SlotPool, int], n: int = 1, timeout: float = 1.0) -> List[Slot]:
        """Takes between 1 and ``n`` staging slots of ``pool`` (:class:`SlotPool` ``LOAD``
        or ``STORE``), waiting up to ``timeout`` seconds for at least one
        (``maru_slots_acquire``). No free slot in time raises
        :class:`~maru.NoSpaceError` (release slots or raise ``load_slots`` /
        ``store_slots``). Each :class:`~maru.Slot` has a writable memoryview ``view``
        straight over the staging buffer; release it when done."""
        pool = SlotPool(pool)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, not {n!r}")
        if timeout < 0:
            raise ValueError("timeout must be >= 0")
        with self._use() as h:
            infos = _capi.slots_acquire(h, int(pool), n, min(int(timeout * 1000), 0xFFFFFFFF))
            slots = [Slot(self, pool, info) for info in infos]
            with self._slot_lock:
                for s in slots:
                    self._slots[s.id] = s
        return slots

    def acquire_slot(self, pool: Union[SlotPool, int], timeout: float = 1.0) -> Slot:
        """One staging slot of ``pool`` (:meth:`acquire_slots` with ``n=1``)."""
        return self.acquire_slots(pool, 1, timeout)[0]

    def release_slots(self, slots: Sequence[Slot]) -> None:
        """Releases each slot (:meth:`Slot.release`)."""
        for s in slots:
            s.release()

    def _own(self, slots: Sequence[Slot], keys: Sequence[str]) -> Tuple[List[bytes], List[int], int]:
        slots = list(slots)
        keys = list(keys)
        if len(slots) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(slots)} slots: give one slot per key")
        seen = set()
        for s in slots:
            if not isinstance(s, Slot):
                raise TypeError(f"expected a Slot, not {type(s).__name__}")
            if s._handler is not self:
                raise InvalidArgumentError(Status.INVALID_ARGUMENT, f"slot {s.id} belongs to another handler")
            if s.id in seen:
                raise InvalidArgumentError(Status.INVALID_ARGUMENT, f"slot {s.id} appears twice in one call")
            seen.add(s.id)
            s._check()
        n = len(keys)
        ks = _keys(keys)
        ids = [s.id for s in slots]
        return ks, ids, n

    def store_slots(
        self,
        keys: Sequence[str],
        slots: Sequence[Slot],
        lengths: Union[None, int, Sequence[int]] = None,
        route_key: Optional[str] = None,
    ) -> List[bool]:
        """Stores ``lengths[i]`` bytes of ``slots[i]`` under ``keys[i]``
        (``maru_store_slots``; ``lengths`` defaults to each slot's ``length``, as set by
        :meth:`Slot.write`). On ``remote_cxl`` the WRITE goes from the slot: no copy.
        Returns per chunk whether it is stored (or was already). The slots stay yours
        (release them), also after a skipped store or a failed call, except those that
        libmaru took back after a transfer whose outcome was unknown
        (``maru_slots_held`` says which): they are retired."""
        slots = list(slots)
        lens_l = _store_lengths(lengths, slots)
        if not slots:
            return []
        ks, ids, _ = self._own(slots, keys)
        rk = _rk(route_key)
        stored = self._slot_call(slots, "store", lambda h: _capi.store_slots(h, ks, ids, lens_l, rk))
        return self._apply_stored(slots, stored)

    def load_slots(self, keys: Sequence[str], slots: Sequence[Slot], route_key: Optional[str] = None) -> List[Optional[int]]:
        """Loads ``keys[i]`` into ``slots[i]`` (``maru_load_slots``; on ``remote_cxl`` the
        READ lands in the slot: no copy). Returns each chunk's length, None where it was
        not loaded. Loaded slots get ``length`` and ``key``; read them through
        :meth:`Slot.data`. A slot whose chunk was not loaded stays yours (``length`` and
        ``key`` None) after a plain miss; only one libmaru took back after a transfer
        whose outcome was unknown is retired (``maru_slots_held`` says which)."""
        slots = list(slots)
        if not slots:
            return []
        ks, ids, _ = self._own(slots, keys)
        rk = _rk(route_key)
        found, lens = self._slot_call(slots, "load", lambda h: _capi.load_slots(h, ks, ids, rk))
        return self._apply_loaded(list(keys), slots, found, lens)

    def _slot_call(self, slots: List[Slot], kind: str, call: Callable[[int], _R]) -> _R:
        """``call(h)`` on the C handle. When it fails (:class:`~maru.MaruError`) the
        slots libmaru took back are retired (:meth:`_settle`; a load's slots lose
        ``length`` and ``key``) before the error is raised again."""
        failed: Optional[MaruError] = None
        with self._use() as h:
            try:
                return call(h)
            except MaruError as e:
                failed = e
        if kind == "load":
            for s in slots:
                s.length = s.key = None
        self._settle(slots, [False] * len(slots), f" (its {kind} failed and libmaru took it back)")
        raise failed

    def submit_store_slots(
        self,
        keys: Sequence[str],
        slots: Sequence[Slot],
        lengths: Union[None, int, Sequence[int]] = None,
        route_key: Optional[str] = None,
    ) -> Op:
        """:meth:`store_slots` without waiting (``maru_submit_store_slots``): returns the
        running :class:`~maru.Op`. The slots are lent to it until it finished (do not
        write into them meanwhile; the wrapper refuses access)."""
        slots = list(slots)
        keys = list(keys)
        lens_l = _store_lengths(lengths, slots)
        if not slots:
            raise ValueError("nothing to submit: no slots")
        ks, ids, _ = self._own(slots, keys)
        with self._use() as h:
            op = _capi.submit_store_slots(h, ks, ids, lens_l, _rk(route_key))
        return self._lend(Op(self, "store", keys, slots, op))

    def submit_load_slots(self, keys: Sequence[str], slots: Sequence[Slot], route_key: Optional[str] = None) -> Op:
        """:meth:`load_slots` without waiting (``maru_submit_load_slots``): returns the
        running :class:`~maru.Op`; the slots are lent to it until it finished."""
        slots = list(slots)
        keys = list(keys)
        if not slots:
            raise ValueError("nothing to submit: no slots")
        ks, ids, _ = self._own(slots, keys)
        with self._use() as h:
            op = _capi.submit_load_slots(h, ks, ids, _rk(route_key))
        return self._lend(Op(self, "load", keys, slots, op))

    def _lend(self, op: Op) -> Op:
        for s in op.slots:
            s._op = op
        return op

    def _settle(self, slots: List[Slot], ok: List[bool], why: str) -> None:
        """After a call: the slots whose chunk was not stored/loaded (``ok`` False) that
        libmaru took back (``maru_slots_held``: no longer the caller's, after a transfer
        whose outcome was unknown) are retired; the others stay held. When libmaru
        cannot say (the handler closed meanwhile), they are all retired."""
        bad = [s for s, k in zip(slots, ok) if not k and s._state == "held"]
        if not bad:
            return
        try:
            held = self._held_ids([s.id for s in bad])
        except MaruError:
            held = [False] * len(bad)
        for s, kept in zip(bad, held):
            if not kept:
                self._release_slot(s, "retired", why, force=True)

    def _apply_stored(self, slots: List[Slot], stored: Any) -> List[bool]:
        out = [bool(stored[i]) for i in range(len(slots))]
        self._settle(slots, out, " (its chunk was not stored and libmaru took it back: the transfer's outcome was unknown)")
        return out

    def _apply_loaded(self, keys: List[str], slots: List[Slot], found: Any, lens: Any) -> List[Optional[int]]:
        out: List[Optional[int]] = []
        for i, s in enumerate(slots):
            if found[i]:
                s.length, s.key = int(lens[i]), keys[i]
                out.append(int(lens[i]))
            else:
                s.length = s.key = None
                out.append(None)
        self._settle(
            slots,
            [x is not None for x in out],
            " (its chunk was not loaded and libmaru took it back: the transfer's outcome was unknown)",
        )
        return out

    def _held_ids(self, ids: List[int]) -> List[bool]:
        if not ids:
            return []
        with self._use() as h:
            return _capi.slots_held(h, ids)

    def slots_held(self, slots: Sequence[Union[Slot, int]]) -> List[bool]:
        """Whether each slot (a :class:`~maru.Slot` or a slot id) is still this caller's
        in libmaru (``maru_slots_held``): False once released, or taken back by libmaru
        after a transfer whose outcome was unknown. The binding already retires such
        slots after each call (``slot.released``); this asks libmaru directly."""
        ids = []
        for s in slots:
            if isinstance(s, Slot):
                ids.append(s.id)
            elif isinstance(s, int) and not isinstance(s, bool) and s >= 0:
                ids.append(s)
            else:
                raise TypeError(f"expected a Slot or a slot id, not {s!r}")
        return self._held_ids(ids)

    def _release_slot(self, slot: Slot, state: str, why: str = "", force: bool = False) -> None:
        """Revokes the slot's views and gives it back (``force``: give it up in Python
        even while objects made from its views live; the C slot then goes back the
        moment the last of them is freed)."""
        with self._slot_lock:
            if slot._state != "held":
                return
            alive = slot._revoke()
            if alive and not force:
                raise BufferError(
                    f"staging slot {slot.id}: {alive} object(s) made from its views (slices, numpy or torch "
                    "arrays) are still alive; drop them, then release again (the slot stays valid meanwhile)"
                )
            slot._state, slot._why = state, why
            self._slots.pop(slot.id, None)
            slot._c_released = True
        self._releases.give_up("slot", slot.id, slot._views)

    def _slot_dropped(self, slot: Slot) -> None:
        """A slot garbage collected while held (from ``Slot.__del__``, which may run
        anywhere, even while this thread holds a lock): given back when nothing reaches
        its memory any more, at once when no memoryview of it (or object made from
        one) is left."""
        if slot._state == "held" and slot._op is None and not slot._c_released:
            slot._c_released = True
            self._releases.give_up("slot", slot.id, slot._views, revoke=False)

    def held_slots(self) -> List[Slot]:
        """The slots this handler handed out that are still held in Python."""
        with self._slot_lock:
            return [s for s in self._slots.values() if s._state == "held"]

    def staging_buffer(self) -> Dict[str, int]:
        """Where the staging buffer lies (``maru_staging_buffer``): ``addr``, ``len``,
        ``slot_size``, ``load_slots`` (the first slots), ``store_slots`` (the rest). A
        slot acquired from a pool lies at one of its pool's places."""
        with self._use() as h:
            st = _capi.staging_buffer(h)
        return {
            "addr": int(st.data or 0),
            "len": int(st.len),
            "slot_size": int(st.slot_size),
            "load_slots": int(st.load_slots),
            "store_slots": int(st.store_slots),
        }

    def staging_view(self) -> memoryview:
        """A writable memoryview of the whole staging buffer, the same one every time
        (released by :meth:`close`, which refuses while something made from it lives).
        Read or write only the slots you hold: the others are libmaru's."""
        with self._slot_lock:
            got = self._region_exports.get(self.STAGING_EXPORT)
        if got is None:
            st = self.staging_buffer()
            with self._slot_lock:
                got = self._region_exports.get(self.STAGING_EXPORT)
                if got is None:
                    vs = _Views()
                    got = (vs, vs.make(st["addr"], st["len"]), st)
                    self._region_exports[self.STAGING_EXPORT] = got
        return got[1]

    #: The key of the staging buffer's memoryview among the region exports.
    STAGING_EXPORT = -1

"""Copies between the caller's memory and Maru's (a chunk read in place, a staging
slot, a page taken for writing in place) with libmaru's own copy (``maru_copy``): one
call for all the pieces of a batch, streaming stores when the batch is large (its
pieces of 4 KiB or more; see ``maru_copy`` in include/maru.h), one store fence. For an
engine whose KV cache is in host memory, where a chunk is several pieces (its blocks,
layer by layer)."""

from __future__ import annotations

from typing import Sequence, Tuple

from . import _capi


def copy_ranges(pieces: Sequence[Tuple[int, int, int]], into_shared: bool = False) -> None:
    """Copies each ``(dst, src, length)`` piece (addresses as ints). ``into_shared``:
    the destinations are Maru's memory that other processes read (a page taken for
    writing in place, a store slot). Every address must be valid for its length and no
    piece may overlap another's destination (as with ``memcpy``: not checked); a NULL
    address raises :class:`~maru.MaruError` before anything is copied."""
    _capi.copy(pieces, into_shared)

"""Chunks read in place (backend ``cxl``), and what removing a key did.

On ``cxl`` this host maps the CXL memory, so a chunk can be read where it lies, with no
copy at all: :meth:`maru.MaruHandler.acquire_views` returns one :class:`View` per found
key, whose :attr:`View.view` is a **read-only** memoryview straight over the mapped
region (``maru_views_acquire``). Each view holds a lease at maru-server that keeps the
chunk's page from being reused (its owner's ``remove`` is refused with
:attr:`RemoveResult.LEASED`) until the view is released, and at most ``valid_ms``
milliseconds (maru-server's ``--lease-timeout-s``, 60 s by default): release views as
soon as their bytes are used (copied to the GPU, hashed, ...). ``remote_cxl`` has no
such mapping (the chunks live in memory nodes' CXL): ``acquire_views`` raises
:class:`~maru.InvalidArgumentError` there; load into staging slots instead
(:meth:`maru.MaruHandler.load_slots`).

Rules the binding enforces, so that a view never shows another key's bytes:

* Releasing a view (:meth:`View.release`, leaving its ``with`` block, closing the
  handler) releases every memoryview it handed out: using one raises ``ValueError``, and
  the :class:`View` itself raises :class:`~maru.SlotReleasedError`.
* When its lease runs out the view **expires**: its memoryviews are released (a
  background timer does it on time, whether or not the view is used), and the
  :class:`View` raises :class:`~maru.ViewExpiredError`. The binding measures
  ``valid_ms`` from just before the acquire call, so it expires a little before the
  lease does, never after.
* A slice or a numpy/torch array made from a view cannot be revoked: ``release()`` (and
  the handler's ``close()``) refuse with ``BufferError`` while one is alive, and the
  view stays valid. Such an array is your responsibility once the lease ran out: drop
  it before ``valid_ms`` passes (the mapping stays valid, its bytes may change).
* ``View.address`` is a raw pointer: valid only while the view is held and not expired.
"""

from __future__ import annotations

import ctypes
import enum
import time
from typing import TYPE_CHECKING, Any, Optional

from .errors import SlotReleasedError, ViewExpiredError
from ._book import _Views
from ._scoped import _Scoped

if TYPE_CHECKING:  # pragma: no cover
    from .handler import MaruHandler


class RemoveResult(enum.IntEnum):
    """``maru_remove_result_t``: what :meth:`maru.MaruHandler.batch_remove` did with
    one key."""

    #: Unpublished: no reader finds it any more; its page is free for this engine's
    #: next stores.
    REMOVED = 0
    #: Not stored (or its pool is unavailable now).
    NOT_FOUND = 1
    #: Refused: another engine stored it (or maru-server's keeper holds it).
    NOT_OWNER = 2
    #: Refused: a reader holds a lease on it now (e.g. a :class:`View`); try later.
    LEASED = 3
    #: Refused: an engine pins it (:meth:`maru.MaruHandler.pin`) until it unpins it.
    PINNED = 4

    @property
    def removed(self) -> bool:
        """Whether the key was removed."""
        return self is RemoveResult.REMOVED


class View(_Scoped):
    """A chunk read in place from this host's mapping of the CXL memory (backend
    ``cxl``), from :meth:`maru.MaruHandler.acquire_views`.

    Attributes: ``id`` (libmaru's view id), ``key``, ``length`` (the chunk's bytes),
    ``valid_ms`` (the lease's duration). Read it through :attr:`view` (a read-only
    memoryview over the mapped region, no copy), :meth:`data`, :meth:`read` (a copy)
    or :attr:`address`; then :meth:`release` it, or use it as a context manager. See
    :mod:`maru.views` for the rules.
    """

    _ends_with = "release"

    def __init__(self, handler: "MaruHandler", key: str, info: Any, t0: float) -> None:
        self._handler = handler
        self.id: int = int(info.id)
        self.key: str = key
        self.length: int = int(info.len)
        self.valid_ms: int = int(info.valid_ms)
        self._addr: int = int(info.data or 0)
        # Measured from before the acquire call: never later than the lease's end.
        self._deadline: float = t0 + self.valid_ms / 1000.0
        self._views = _Views()
        self._view: Optional[memoryview] = None
        self._state = "held"  # held | expired | released
        self._why = ""
        self._c_released = False

    def __repr__(self) -> str:
        return f"<View {self.id} {self.key!r} {self._state} length={self.length}>"

    def _dropped(self) -> None:
        self._handler._view_dropped(self)

    def __len__(self) -> int:
        return self.length

    # State --------------------------------------------------------------------------

    @property
    def released(self) -> bool:
        """Whether the view was released or expired (no access any more)."""
        if self._state == "held" and time.monotonic() >= self._deadline:
            self._handler._expire_view(self)
        return self._state != "held"

    @property
    def expired(self) -> bool:
        """Whether the view's lease ran out (before it was released)."""
        return self.released and self._state == "expired"

    def expires_in(self) -> float:
        """Seconds until the lease runs out (0 once expired or released)."""
        if self.released:
            return 0.0
        return max(0.0, self._deadline - time.monotonic())

    def _check(self) -> None:
        if self.released:
            if self._state == "expired":
                raise ViewExpiredError(
                    f"the view of chunk {self.key!r} expired (its lease of {self.valid_ms} ms ran out): "
                    "its page may hold other bytes now; acquire it again"
                )
            raise SlotReleasedError(f"the view of chunk {self.key!r} was released{self._why}; acquire it again")

    # Access -------------------------------------------------------------------------

    @property
    def view(self) -> memoryview:
        """A read-only memoryview of the chunk (``length`` bytes) in the mapped region,
        the same object on every access until the view is released or expires (then it
        is released too)."""
        self._check()
        if self._view is None:
            self._view = self._views.make(self._addr, self.length, readonly=True)
        return self._view

    def data(self) -> memoryview:
        """A new read-only memoryview of the chunk, released with the view."""
        self._check()
        return self._views.make(self._addr, self.length, readonly=True)

    def exported_writable(self) -> memoryview:
        """A new memoryview of the chunk that *claims* to be writable, released with the
        view: for code that takes an address with ``ctypes.c_char.from_buffer`` (which
        refuses read-only buffers) and only reads. The memory is still mapped read-only:
        a write through it kills the process (SIGSEGV), it never changes the chunk."""
        self._check()
        return self._views.make(self._addr, self.length, readonly=False)

    def read(self) -> bytes:
        """A copy of the chunk's bytes."""
        self._check()
        b = ctypes.string_at(self._addr, self.length) if self.length else b""
        self._check()  # expired while copying: the copy may mix in other bytes
        return b

    @property
    def address(self) -> int:
        """The chunk's address in the mapping (read-only memory; for a copy kernel or
        ``cudaMemcpyAsync``). Valid only while the view is held and not expired: the
        binding cannot revoke a raw address."""
        self._check()
        return self._addr

    # Release ------------------------------------------------------------------------

    def release(self) -> None:
        """Ends the view: its lease goes back and every memoryview it handed out is
        released. Harmless twice (and after expiry). Raises ``BufferError`` (nothing
        released, the view stays valid) while an object made from one of its
        memoryviews (a slice, a numpy or torch array) is alive."""
        self._handler._release_view(self, "released")

    def _revoke(self) -> int:
        self._view = None
        return self._views.revoke()

"""``_Scoped``: how the binding's objects that hold something in libmaru (a handler, a
slot, a view, an operation) end: at the end of a ``with`` block, or when garbage
collected."""

from __future__ import annotations

from typing import Any, TypeVar

_T = TypeVar("_T", bound="_Scoped")


class _Scoped:
    """``with obj:`` ends it with its method named :attr:`_ends_with` (``close`` or
    ``release``). Garbage collection calls :meth:`_dropped` (by default that method
    too), which may run anywhere, even at interpreter exit: its errors are swallowed."""

    #: The name of the method that ends it.
    _ends_with = "close"

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: Any) -> None:
        getattr(self, self._ends_with)()

    def __del__(self) -> None:
        try:
            self._dropped()
        except Exception:
            pass

    def _dropped(self) -> None:
        getattr(self, self._ends_with)()

"""The process-wide memory hook: how each handler's staging buffer is registered with
the GPU driver (pinned for DMA) before first use. It applies to handlers opened after
it is set.

* :func:`set_memory_hook_auto`: libmaru dlopens libcudart (``MARU_CUDART`` names another
  library) and calls ``cudaHostRegister`` on each staging buffer; without CUDA its log
  says so and handlers use pageable memory.
* :func:`set_memory_hook`: your own Python callables ``register(ptr, length) -> int``
  (0 on success; anything else fails the handler's open with
  :class:`~maru.ConfigError`) and ``unregister(ptr, length)``; e.g. with torch:
  ``torch.cuda.cudart().cudaHostRegister(ptr, length, 0)``.
* ``set_memory_hook(None)``: no hook (the default).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Callable, Optional

from ._lib import MEM_REGISTER_FN, MEM_UNREGISTER_FN, last_error, lib, status_str
from .errors import Status, error_for

log = logging.getLogger(__name__)

RegisterFn = Callable[[int, int], int]
UnregisterFn = Callable[[int, int], None]

# The ctypes callbacks must outlive every handler opened with them: never dropped.
_keep: list = []


def _check(st: int) -> None:
    if st != Status.OK:
        raise error_for(st, last_error() or status_str(st))


def set_memory_hook(register: Optional[RegisterFn], unregister: Optional[UnregisterFn] = None) -> None:
    """Sets the memory hook for handlers opened from now on (``maru_set_memory_hook``):
    ``register(ptr, length)`` is called with each staging buffer before first use and
    must return 0; ``unregister(ptr, length)`` when the handler closes. An exception in
    ``register`` counts as a failure (logged). ``register=None`` removes the hook."""
    if register is None:
        _check(lib.maru_set_memory_hook(ctypes.cast(None, MEM_REGISTER_FN), ctypes.cast(None, MEM_UNREGISTER_FN), None))
        return

    def c_register(_ctx: int, ptr: int, length: int) -> int:
        try:
            return int(register(ptr or 0, length))
        except Exception:  # noqa: BLE001 - an exception must not cross into libmaru
            log.exception("memory hook register(%#x, %d) raised", ptr or 0, length)
            return -1

    def c_unregister(_ctx: int, ptr: int, length: int) -> None:
        if unregister is None:
            return
        try:
            unregister(ptr or 0, length)
        except Exception:  # noqa: BLE001
            log.exception("memory hook unregister(%#x, %d) raised", ptr or 0, length)

    reg = MEM_REGISTER_FN(c_register)
    unreg = MEM_UNREGISTER_FN(c_unregister) if unregister is not None else ctypes.cast(None, MEM_UNREGISTER_FN)
    _keep.append((reg, unreg))
    _check(lib.maru_set_memory_hook(reg, unreg, None))


def set_memory_hook_auto() -> None:
    """Sets the memory hook to libmaru's CUDA auto-registration
    (``maru_set_memory_hook_auto``) for handlers opened from now on."""
    _check(lib.maru_set_memory_hook_auto())

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

import logging
from typing import Callable, Optional

from . import _capi

log = logging.getLogger(__name__)

RegisterFn = Callable[[int, int], int]
UnregisterFn = Callable[[int, int], None]


def set_memory_hook(register: Optional[RegisterFn], unregister: Optional[UnregisterFn] = None) -> None:
    """Sets the memory hook for handlers opened from now on (``maru_set_memory_hook``):
    ``register(ptr, length)`` is called with each staging buffer before first use and
    must return 0; ``unregister(ptr, length)`` when the handler closes. An exception in
    ``register`` counts as a failure (logged). ``register=None`` removes the hook."""
    if register is None:
        _capi.set_memory_hook(None, None)
        return

    def safe_register(ptr: int, length: int) -> int:
        try:
            return int(register(ptr, length))
        except Exception:  # noqa: BLE001 - an exception must not cross into libmaru
            log.exception("memory hook register(%#x, %d) raised", ptr, length)
            return -1

    def safe_unregister(ptr: int, length: int) -> None:
        if unregister is None:
            return
        try:
            unregister(ptr, length)
        except Exception:  # noqa: BLE001
            log.exception("memory hook unregister(%#x, %d) raised", ptr, length)

    _capi.set_memory_hook(safe_register, safe_unregister if unregister is not None else None)


def set_memory_hook_auto() -> None:
    """Sets the memory hook to libmaru's CUDA auto-registration
    (``maru_set_memory_hook_auto``) for handlers opened from now on."""
    _capi.set_memory_hook_auto()

"""Addresses of Python buffers for the C calls, without copying them.

* Writable buffers (bytearray, writable memoryview, numpy array, ...) are exported with
  ``(ctypes.c_char * n).from_buffer(...)``: no copy.
* Read-only buffers (bytes, read-only memoryviews and slices of them, read-only numpy
  arrays, ...) are exported with ``PyObject_GetBuffer`` through ``ctypes.pythonapi``:
  no copy either.
* Only where ``ctypes.pythonapi`` does not exist (not CPython) is a read-only buffer
  copied once, with ``from_buffer_copy``.

The export is held for the duration of the ``with`` block and released after it, so a
bytearray can be resized again once the call returned.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any, Iterator, Tuple

Buffer = Any  # anything with the buffer protocol: bytes, bytearray, memoryview, numpy.ndarray

_PyBUF_SIMPLE = 0  # contiguous bytes, read-only allowed


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (stable layout since 3.3)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


try:
    _get_buffer = ctypes.pythonapi.PyObject_GetBuffer
    _get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
    _get_buffer.restype = ctypes.c_int
    _release_buffer = ctypes.pythonapi.PyBuffer_Release
    _release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
    _release_buffer.restype = None
    HAVE_PYTHONAPI = True
except (AttributeError, OSError):  # not CPython
    HAVE_PYTHONAPI = False


def _bytes_view(data: Buffer) -> memoryview:
    mv = memoryview(data)
    if not mv.c_contiguous:
        mv.release()
        raise ValueError("the buffer must be C-contiguous")
    return mv if (mv.format == "B" and mv.ndim == 1) else mv.cast("B")


@contextlib.contextmanager
def readable(data: Buffer) -> Iterator[Tuple[int, int]]:
    """``(address, length)`` of ``data``'s bytes while the block runs (see the module
    docstring for which buffers are copied: only read-only ones outside CPython)."""
    mv = _bytes_view(data)
    n = mv.nbytes
    try:
        if n == 0:
            yield 0, 0
        elif not mv.readonly:
            arr = (ctypes.c_char * n).from_buffer(mv)
            try:
                yield ctypes.addressof(arr), n
            finally:
                del arr
        elif HAVE_PYTHONAPI:
            view = _PyBuffer()
            _get_buffer(mv, ctypes.byref(view), _PyBUF_SIMPLE)
            try:
                yield view.buf or 0, n
            finally:
                _release_buffer(ctypes.byref(view))
        else:
            copy = (ctypes.c_char * n).from_buffer_copy(mv)
            yield ctypes.addressof(copy), n
    finally:
        mv.release()


@contextlib.contextmanager
def writable(buffer: Buffer) -> Iterator[Tuple[int, int]]:
    """``(address, capacity)`` of a writable buffer while the block runs (never copied).
    A read-only buffer raises TypeError."""
    mv = _bytes_view(buffer)
    try:
        if mv.readonly:
            raise TypeError(f"a writable buffer is needed, not a read-only {type(buffer).__name__}")
        n = mv.nbytes
        if n == 0:
            yield 0, 0
            return
        arr = (ctypes.c_char * n).from_buffer(mv)
        try:
            yield ctypes.addressof(arr), n
        finally:
            del arr
    finally:
        mv.release()

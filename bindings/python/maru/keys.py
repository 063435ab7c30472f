"""Chunk keys as connectors use them: prefix-chained hashes of token chunks within a
namespace, so two engines with the same prompt prefix compute the same keys."""

from __future__ import annotations

import hashlib
import struct
from typing import List, Sequence


def chunk_keys(tokens: Sequence[int], chunk_tokens: int, namespace: str) -> List[str]:
    """Keys of the full chunks of ``tokens``: key i = sha256(key i-1 ‖ tokens of chunk i),
    the first chained from the namespace. A partial last chunk gets no key."""
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    prev = hashlib.sha256(b"maru-ns\0" + namespace.encode("utf-8")).digest()
    keys = []
    for start in range(0, len(tokens) - chunk_tokens + 1, chunk_tokens):
        chunk = tokens[start : start + chunk_tokens]
        h = hashlib.sha256(prev)
        h.update(struct.pack(f"<{len(chunk)}i", *chunk))
        prev = h.digest()
        keys.append(prev.hex()[:32])
    return keys

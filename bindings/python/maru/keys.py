"""Chunk keys as connectors use them: prefix-chained hashes of token chunks within a
namespace, so two engines with the same prompt prefix compute the same keys.

For tokens ``t`` cut into full chunks ``c_0, c_1, ...`` of ``chunk_tokens`` ids each::

    d_0 = sha256(b"maru-chunk-v1\\0" + namespace.encode("utf-8") + b"\\0" + int32le(c_0))
    d_i = sha256(d_{i-1} + int32le(c_i))          for i >= 1
    key_i = d_i.hex()                             (64 lowercase hex characters)

``int32le`` packs each token id as a little-endian signed 32-bit integer. Key ``i``
depends on every token before the end of chunk ``i`` and on the namespace, so equal
prefixes give equal keys, a change anywhere changes that chunk's key and all later ones,
and keys never match across namespaces. Put everything that makes KV bytes
incompatible into the namespace (model, dtype, block/chunk size, tensor-parallel rank,
...): for example ``f"{model}/{layout}"``. A partial last chunk has no key (it is not
stored).
"""

from __future__ import annotations

import hashlib
import struct
from typing import List, Sequence

_DOMAIN = b"maru-chunk-v1\0"


def chunk_keys(tokens: Sequence[int], chunk_tokens: int, namespace: str) -> List[str]:
    """The keys of the full chunks of ``tokens`` (see the module docstring).

    Raises ValueError when ``chunk_tokens`` is not positive or a token id does not fit
    in a signed 32-bit integer.
    """
    if not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be a positive int, not {chunk_tokens!r}")
    if not isinstance(namespace, str):
        raise TypeError("namespace must be a str")
    fmt = struct.Struct(f"<{chunk_tokens}i")
    keys: List[str] = []
    prev = b""
    for start in range(0, len(tokens) - chunk_tokens + 1, chunk_tokens):
        chunk = tokens[start : start + chunk_tokens]
        try:
            packed = fmt.pack(*chunk)
        except struct.error as e:
            raise ValueError(f"token ids of chunk {len(keys)} must be int32: {e}") from e
        h = hashlib.sha256()
        if not keys:
            h.update(_DOMAIN + namespace.encode("utf-8") + b"\0")
        else:
            h.update(prev)
        h.update(packed)
        prev = h.digest()
        keys.append(prev.hex())
    return keys

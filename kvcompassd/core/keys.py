"""Prefix keys: 63-bit truncated SHA-256 of a namespace salt and the first ``c`` tokens.

``key(c) = low 63 bits of SHA-256(salt || tokens[:c] as uint32 little-endian)``, where "low 63
bits" means the first 8 digest bytes read as a little-endian uint64 with the top bit cleared
(keys fit in a signed 64-bit integer, as the index and the wire expect). All requested lengths
are hashed in one incremental pass over the prompt: each byte is hashed once and the hash state
is copied at each length, so ``prefix_keys`` costs about one SHA-256 over the prompt plus a
small constant per length.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["KEY_MASK", "KeyInputError", "namespace_salt", "prefix_key", "prefix_keys", "tokens_to_bytes"]

KEY_MASK = (1 << 63) - 1
_KEY_MASK_U64 = np.uint64(KEY_MASK)
_DOMAIN = b"kvcompass/prefix-key/v1\x00"
_TOKEN_LIMIT = 1 << 32


class KeyInputError(ValueError):
    """Tokens or lengths passed to the key functions are invalid."""


def namespace_salt(model: str, tenant: str = "") -> bytes:
    """Salt that separates key spaces of different models and sharing groups.

    Domain tag, then each field as a 4-byte little-endian length and its UTF-8 bytes, so that
    no (model, tenant) pair can produce the bytes of another pair.
    """
    if not isinstance(model, str) or not model:
        raise KeyInputError(f"model must be a non-empty string, got {model!r}")
    if not isinstance(tenant, str):
        raise KeyInputError(f"tenant must be a string, got {tenant!r}")
    parts = [_DOMAIN]
    for text in (model, tenant):
        raw = text.encode("utf-8")
        parts.append(len(raw).to_bytes(4, "little"))
        parts.append(raw)
    return b"".join(parts)


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Tokens as uint32 little-endian bytes; rejects negative or >= 2^32 token ids."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise KeyInputError(f"tokens must be one-dimensional, got shape {tokens.shape}")
        if tokens.dtype == np.dtype("<u4"):
            return tokens.tobytes()
        if tokens.size == 0:
            return b""
        if tokens.dtype.kind == "u":
            if int(tokens.max()) >= _TOKEN_LIMIT:
                raise KeyInputError(f"token ids must be < 2^32, got {int(tokens.max())}")
        elif tokens.dtype.kind == "i":
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= _TOKEN_LIMIT:
                raise KeyInputError(f"token ids must be in [0, 2^32), got {lo if lo < 0 else hi}")
        else:
            raise KeyInputError(f"tokens must be integers, got dtype {tokens.dtype}")
        return tokens.astype("<u4").tobytes()
    # Let numpy infer the dtype: ints become int64, while floats, bools or ints beyond int64
    # come out as float/bool/object/uint64 and are rejected or range-checked above.
    try:
        array = np.asarray(tokens)
    except (ValueError, TypeError) as exc:
        raise KeyInputError(f"tokens must be a flat sequence of integers: {exc}") from None
    if array.dtype.kind == "O":
        raise KeyInputError("token ids must be integers in [0, 2^32)")
    if array.size == 0:
        array = array.astype(np.uint32)
    return tokens_to_bytes(array)


def prefix_keys(tokens: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray, salt: bytes) -> np.ndarray:
    """Keys of ``tokens[:c]`` for every ``c`` in ``lengths`` (strictly ascending, 1 <= c <= len(tokens)).

    Returns a ``uint64`` array aligned with ``lengths``.
    """
    data = tokens_to_bytes(tokens)
    limit = len(data)
    if isinstance(lengths, np.ndarray):
        lengths = lengths.tolist()
    if not lengths:
        return np.zeros(0, dtype=np.uint64)
    view = memoryview(data)
    state = hashlib.sha256(salt)
    update, copy = state.update, state.copy
    digests: list[bytes] = []
    append = digests.append
    previous = 0
    try:
        for c in lengths:
            end = 4 * c
            if not previous < end <= limit:
                raise KeyInputError(
                    f"lengths must be strictly ascending within 1..{limit // 4}, got {c} after {previous // 4}"
                )
            update(view[previous:end])
            append(copy().digest())
            previous = end
    except TypeError:
        raise KeyInputError(f"lengths must be integers, got {list(lengths)!r}") from None
    # First 8 bytes of each 32-byte digest, little-endian, top bit cleared.
    return np.frombuffer(b"".join(digests), dtype="<u8")[::4] & _KEY_MASK_U64


def prefix_key(tokens: Sequence[int] | np.ndarray, length: int, salt: bytes) -> int:
    """The key of ``tokens[:length]`` as a Python int."""
    return int(prefix_keys(tokens, (length,), salt)[0])

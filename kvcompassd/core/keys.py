"""Prefix keys: 63-bit truncated SHA-256 of a namespace salt and the first ``c`` tokens.

``key(c) = low 63 bits of SHA-256(salt || tokens[:c] as uint32 little-endian)``, where "low 63
bits" means the first 8 digest bytes read as a little-endian uint64 with the top bit cleared
(keys fit in a signed 64-bit integer, as the index and the wire expect). All requested lengths
are hashed in one incremental pass over the prompt: each byte is hashed once and the hash state
is copied at each length, so ``prefix_keys`` costs about one SHA-256 over the prompt plus a
small constant per length.

``prefix_keys`` runs in C (``ludo_c/kvc_keys.c`` over ``kvc_sha256.c``: SHA-NI when the CPU has
it, else portable C); ``prefix_keys_reference`` is the hashlib definition it is tested equal to,
and also what ``prefix_keys`` falls back on for inputs the C call does not take (it then raises
the same errors). ``sha256_digest`` exposes the C hash itself, on either backend, for tests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ._ludo_cffi import ffi, lib

__all__ = ["KEY_MASK", "SHA256_BACKENDS", "KeyInputError", "namespace_salt", "prefix_key", "prefix_keys",
           "prefix_keys_reference", "sha256_backend", "sha256_backend_available", "sha256_digest", "token_buffer",
           "tokens_to_bytes"]

KEY_MASK = (1 << 63) - 1
_KEY_MASK_U64 = np.uint64(KEY_MASK)
_DOMAIN = b"kvcompass/prefix-key/v1\x00"
_TOKEN_LIMIT = 1 << 32
# The C hash's compression backends by name ("auto": SHA-NI if this CPU has it, else portable).
SHA256_BACKENDS = {"auto": int(lib.KVC_SHA256_AUTO), "portable": int(lib.KVC_SHA256_PORTABLE),
                   "sha-ni": int(lib.KVC_SHA256_SHANI)}
_AUTO = SHA256_BACKENDS["auto"]
_I64 = np.dtype(np.int64)
_U32_LE = np.dtype("<u4")
_from_buffer = ffi.from_buffer
_c_prefix_keys = lib.kvc_prefix_keys


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


def token_buffer(tokens: Sequence[int] | np.ndarray) -> tuple[np.ndarray | bytes, int]:
    """(uint32 little-endian buffer, token count) for the C calls: a contiguous ``<u4`` array
    as it is (no copy), anything else through ``tokens_to_bytes`` (checked and converted)."""
    if tokens.__class__ is np.ndarray and tokens.dtype == _U32_LE and tokens.ndim == 1 and tokens.flags.c_contiguous:
        return tokens, tokens.shape[0]
    data = tokens_to_bytes(tokens)
    return data, len(data) // 4


def prefix_keys(tokens: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray, salt: bytes, *,
                backend: str = "auto") -> np.ndarray:
    """Keys of ``tokens[:c]`` for every ``c`` in ``lengths`` (strictly ascending, 1 <= c <= len(tokens)).

    Returns a ``uint64`` array aligned with ``lengths``. ``backend`` names the C hash's
    compression function (``SHA256_BACKENDS``); only tests force one.
    """
    code = _backend_code(backend)
    data, n_tokens = token_buffer(tokens)
    if lengths.__class__ is np.ndarray and lengths.dtype == _I64 and lengths.ndim == 1:
        wanted = lengths
    else:
        if isinstance(lengths, np.ndarray):
            lengths = lengths.tolist()
        if not lengths:
            return np.zeros(0, dtype=np.uint64)
        try:
            wanted = np.asarray(lengths)
        except (ValueError, TypeError):
            wanted = None
        if wanted is None or wanted.dtype != _I64 or wanted.ndim != 1:
            return prefix_keys_reference(data, lengths, salt)  # other types: its checks, its errors
    if salt.__class__ is not bytes:
        return prefix_keys_reference(data, wanted, salt)
    wanted = np.ascontiguousarray(wanted)
    keys = np.empty(wanted.size, dtype=np.uint64)
    rc = _c_prefix_keys(salt, len(salt), _from_buffer("uint8_t[]", data), n_tokens,
                        _from_buffer("int64_t[]", wanted), wanted.size, code, _from_buffer("uint64_t[]", keys))
    if rc:  # lengths out of order or range: the reference names the offending one
        return prefix_keys_reference(data, wanted, salt)
    return keys


def prefix_keys_reference(tokens: Sequence[int] | np.ndarray | bytes, lengths: Sequence[int] | np.ndarray,
                          salt: bytes) -> np.ndarray:
    """``prefix_keys`` with hashlib: the definition the C path is tested against.

    ``tokens`` may also be their uint32 little-endian bytes.
    """
    data = tokens if isinstance(tokens, bytes) else tokens_to_bytes(tokens)
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


def sha256_backend_available(backend: str) -> bool:
    """True if the C hash can run ``backend`` (a ``SHA256_BACKENDS`` name) on this CPU."""
    code = SHA256_BACKENDS.get(backend)
    return code is not None and bool(lib.kvc_sha256_backend_available(code))


def sha256_backend() -> str:
    """The compression backend ``"auto"`` uses on this CPU: ``"sha-ni"`` or ``"portable"``."""
    return "sha-ni" if lib.kvc_sha256_auto_backend() == SHA256_BACKENDS["sha-ni"] else "portable"


def sha256_digest(data: bytes, *, backend: str = "auto") -> bytes:
    """SHA-256 of ``data`` by the C hash the keys use (for tests and benchmarks)."""
    code = _backend_code(backend)
    digest = ffi.new("uint8_t[32]")
    lib.kvc_sha256_digest(_from_buffer("uint8_t[]", data), len(data), code, digest)
    return bytes(ffi.buffer(digest))


def _backend_code(backend: str) -> int:
    if backend == "auto":
        return _AUTO
    code = SHA256_BACKENDS.get(backend)
    if code is None:
        raise KeyInputError(f"unknown SHA-256 backend {backend!r}; known: {sorted(SHA256_BACKENDS)}")
    if not sha256_backend_available(backend):
        raise KeyInputError(f"SHA-256 backend {backend!r} is not available on this CPU")
    return code


def prefix_key(tokens: Sequence[int] | np.ndarray, length: int, salt: bytes) -> int:
    """The key of ``tokens[:length]`` as a Python int."""
    return int(prefix_keys(tokens, (length,), salt)[0])

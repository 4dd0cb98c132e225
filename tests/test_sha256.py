"""The C SHA-256 (both compression backends) and the C prefix keys equal hashlib, bit for bit."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.core.keys import (KEY_MASK, KeyInputError, namespace_salt, prefix_keys, prefix_keys_reference,
                                  sha256_backend, sha256_backend_available, sha256_digest)

_available = sha256_backend_available


# SHA-NI is tested wherever the CPU has it (this project's machines do); elsewhere it is skipped.
BACKENDS = [pytest.param(name, marks=pytest.mark.skipif(not _available(name), reason=f"no {name} on this CPU"))
            for name in ("portable", "sha-ni")] + ["auto"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_digest_of_every_length_around_the_block_boundaries(backend: str) -> None:
    data = bytes((i * 131 + 7) % 256 for i in range(300))
    for n in range(len(data) + 1):  # 0..300: one, two and several blocks, every padding case
        assert sha256_digest(data[:n], backend=backend) == hashlib.sha256(data[:n]).digest(), n


@pytest.mark.parametrize("backend", BACKENDS)
def test_digest_of_a_long_stream(backend: str) -> None:
    data = np.random.default_rng(3).integers(0, 256, 1 << 17, dtype=np.uint8).tobytes()
    for n in (16384, 16384 + 51, len(data)):
        assert sha256_digest(data[:n], backend=backend) == hashlib.sha256(data[:n]).digest()


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=1000))
def test_digest_equals_hashlib_on_random_bytes(data: bytes) -> None:
    want = hashlib.sha256(data).digest()
    for name in ("portable", "sha-ni"):
        if _available(name):
            assert sha256_digest(data, backend=name) == want, name


@st.composite
def salts_tokens_lengths(draw) -> tuple[bytes, np.ndarray, list[int]]:
    salt = draw(st.binary(min_size=1, max_size=130))
    n = draw(st.integers(1, 700))
    seed = draw(st.integers(0, 2**32 - 1))
    tokens = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    lengths = sorted(draw(st.sets(st.integers(1, n), min_size=1, max_size=30)))
    return salt, tokens, lengths


@settings(max_examples=200, deadline=None)
@given(case=salts_tokens_lengths())
def test_c_prefix_keys_equal_the_hashlib_reference(case) -> None:
    salt, tokens, lengths = case
    want = prefix_keys_reference(tokens, lengths, salt).tolist()
    assert all(k <= KEY_MASK for k in want)
    for name in ("portable", "sha-ni", "auto"):
        if _available(name):
            got = prefix_keys(tokens, np.array(lengths, dtype=np.int64), salt, backend=name)
            assert got.dtype == np.uint64 and got.tolist() == want, name
            assert prefix_keys(tokens.astype(np.int64), lengths, salt, backend=name).tolist() == want, name


def test_the_production_salt_and_a_4096_token_prompt() -> None:
    salt = namespace_salt("meta-llama/Llama-3.1-8B-Instruct", "team-a")
    tokens = np.random.default_rng(11).integers(0, 128_256, 4096, dtype=np.uint32)
    lengths = [64, 128, 256, 512, 1024, 2048, 2976, 3776, 4096]
    want = prefix_keys_reference(tokens, lengths, salt)
    for name in ("portable", "sha-ni"):
        if _available(name):
            np.testing.assert_array_equal(prefix_keys(tokens, lengths, salt, backend=name), want)
    # A strided uint32 view goes through the conversion, a big-endian array too.
    doubled = np.repeat(tokens, 2)[::2]
    np.testing.assert_array_equal(prefix_keys(doubled, lengths, salt), want)
    np.testing.assert_array_equal(prefix_keys(tokens.astype(">u4"), lengths, salt), want)


def test_bad_lengths_in_an_int64_array_raise_the_reference_errors() -> None:
    tokens = np.arange(8, dtype=np.uint32)
    for lengths in ([0], [3, 3], [4, 2], [9], [-1]):
        with pytest.raises(KeyInputError, match="strictly ascending"):
            prefix_keys(tokens, np.array(lengths, dtype=np.int64), b"s")
    assert prefix_keys(tokens, np.zeros(0, dtype=np.int64), b"s").shape == (0,)


def test_backend_names() -> None:
    assert sha256_backend() in ("sha-ni", "portable")
    assert sha256_backend() == ("sha-ni" if _available("sha-ni") else "portable")
    assert _available("auto") and _available("portable") and not _available("openssl")
    with pytest.raises(KeyInputError, match="unknown SHA-256 backend"):
        prefix_keys([1, 2], [1], b"s", backend="openssl")
    with pytest.raises(KeyInputError, match="unknown SHA-256 backend"):
        sha256_digest(b"", backend="fast")

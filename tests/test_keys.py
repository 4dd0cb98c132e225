"""Prefix keys: a reference SHA-256 per length, the prefix property, salt separation, input checks."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.core.keys import KEY_MASK, KeyInputError, namespace_salt, prefix_key, prefix_keys

SALT = namespace_salt("meta-llama/Llama-3.1-8B-Instruct")


def reference_key(tokens: list[int], c: int, salt: bytes) -> int:
    data = b"".join(t.to_bytes(4, "little") for t in tokens[:c])
    digest = hashlib.sha256(salt + data).digest()
    return int.from_bytes(digest[:8], "little") & KEY_MASK


token_lists = st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300)


@st.composite
def tokens_and_lengths(draw) -> tuple[list[int], list[int]]:
    tokens = draw(token_lists)
    lengths = sorted(draw(st.sets(st.integers(1, len(tokens)), min_size=1, max_size=20)))
    return tokens, lengths


@settings(max_examples=150, deadline=None)
@given(tokens_and_lengths())
def test_keys_equal_one_sha256_per_length(case: tuple[list[int], list[int]]) -> None:
    tokens, lengths = case
    keys = prefix_keys(tokens, lengths, SALT)
    assert keys.dtype == np.uint64 and keys.shape == (len(lengths),)
    assert keys.tolist() == [reference_key(tokens, c, SALT) for c in lengths]
    assert all(k <= KEY_MASK for k in keys.tolist())


@settings(max_examples=100, deadline=None)
@given(tokens_and_lengths(), st.lists(st.integers(0, 2**32 - 1), max_size=50))
def test_key_at_c_depends_only_on_the_first_c_tokens(case, tail: list[int]) -> None:
    tokens, lengths = case
    c = lengths[-1]
    other = tokens[:c] + tail
    assert prefix_keys(tokens, lengths, SALT).tolist() == prefix_keys(other, lengths, SALT).tolist()


@settings(max_examples=100, deadline=None)
@given(tokens_and_lengths(), st.data())
def test_changing_a_token_changes_every_key_that_covers_it(case, data) -> None:
    tokens, lengths = case
    position = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[position] = (changed[position] + 1) % 2**32
    before = prefix_keys(tokens, lengths, SALT).tolist()
    after = prefix_keys(changed, lengths, SALT).tolist()
    for c, k0, k1 in zip(lengths, before, after):
        assert (k0 == k1) == (c <= position)


def test_list_and_array_inputs_agree_and_are_deterministic() -> None:
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 128_000, size=4096)
    lengths = [64, 128, 2976, 4096]
    from_i64 = prefix_keys(tokens, lengths, SALT)
    assert from_i64.tolist() == prefix_keys(tokens.astype(np.uint32), lengths, SALT).tolist()
    assert from_i64.tolist() == prefix_keys(tokens.tolist(), lengths, SALT).tolist()
    assert from_i64.tolist() == prefix_keys(tokens.astype(">u4"), lengths, SALT).tolist()
    assert prefix_key(tokens, 128, SALT) == int(from_i64[1])


def test_salt_separates_models_and_tenants() -> None:
    tokens = list(range(64))
    salts = [namespace_salt("m"), namespace_salt("m", "t1"), namespace_salt("m", "t2"), namespace_salt("n")]
    keys = {prefix_key(tokens, 64, s) for s in salts}
    assert len(keys) == len(salts)
    # Length prefixes make the field boundary unambiguous.
    assert namespace_salt("ab", "c") != namespace_salt("a", "bc")
    assert namespace_salt("m") == namespace_salt("m", "")


@pytest.mark.parametrize(
    "tokens",
    [[-1], [2**32], [2**70], [1.5], [True], np.array([1.0]), np.array([[1, 2]]), np.array([-3], dtype=np.int32),
     np.array([2**32], dtype=np.uint64), ["a"]],
)
def test_bad_tokens_are_rejected(tokens) -> None:
    with pytest.raises(KeyInputError):
        prefix_keys(tokens, [1], SALT)


@pytest.mark.parametrize("lengths", [[0], [2, 2], [3, 2], [5], [-1], [1.5], ["2"]])
def test_bad_lengths_are_rejected(lengths) -> None:
    with pytest.raises(KeyInputError):
        prefix_keys([1, 2, 3, 4], lengths, SALT)


def test_no_lengths_and_bad_salt_inputs() -> None:
    assert prefix_keys([1, 2], [], SALT).shape == (0,)
    with pytest.raises(KeyInputError):
        namespace_salt("")
    with pytest.raises(ValueError):
        namespace_salt("m", None)  # type: ignore[arg-type]

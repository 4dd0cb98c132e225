"""BlockStored.trusted builds exactly what the validating constructor builds from canonical fields."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.engine.kvevents import BlockRemoved, BlockStored, decode_message, encode_batch

int64 = st.integers(-(1 << 63), (1 << 63) - 1)
token = st.integers(0, (1 << 32) - 1)


@st.composite
def canonical_fields(draw):
    size = draw(st.integers(1, 8))
    n = draw(st.integers(1, 4))
    hashes = tuple(draw(st.lists(int64, min_size=n, max_size=n)))
    count = draw(st.integers((n - 1) * size + 1, n * size))
    tokens = tuple(draw(st.lists(token, min_size=count, max_size=count)))
    return (hashes, draw(st.none() | int64), tokens, size, draw(st.none() | st.integers(0, 100)),
            draw(st.sampled_from([None, "GPU", "CPU_PINNED", "DISK"])))


@settings(max_examples=200, deadline=None)
@given(canonical_fields())
def test_trusted_equals_validated(fields) -> None:
    trusted, validated = BlockStored.trusted(*fields), BlockStored(*fields)
    assert trusted == validated and hash(trusted) == hash(validated)
    assert dataclasses.astuple(trusted) == dataclasses.astuple(validated)
    assert list(trusted.blocks()) == list(validated.blocks())
    # and it travels the same on the wire
    assert encode_batch(0, 1.0, [trusted]) == encode_batch(0, 1.0, [validated])
    assert decode_message(encode_batch(0, 1.0, [trusted])).events == (validated,)


def test_trusted_is_still_frozen() -> None:
    event = BlockStored.trusted((1,), None, (5,), 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.block_size = 8  # type: ignore[misc]


@settings(max_examples=200, deadline=None)
@given(st.lists(int64, min_size=1, max_size=4).map(tuple), st.sampled_from([None, "GPU", "CPU_PINNED", "DISK"]))
def test_trusted_removal_equals_validated(hashes, medium) -> None:
    trusted, validated = BlockRemoved.trusted(hashes, medium), BlockRemoved(hashes, medium)
    assert trusted == validated and hash(trusted) == hash(validated)
    assert dataclasses.astuple(trusted) == dataclasses.astuple(validated)
    assert encode_batch(0, 1.0, [trusted]) == encode_batch(0, 1.0, [validated])
    assert decode_message(encode_batch(0, 1.0, [trusted])).events == (validated,)

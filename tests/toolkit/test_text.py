"""``adapters.toolkit.chunk_text`` / ``utf16_units``: the one UTF-16 chunker (Telegram cuts at
3,500 units, Signal at 2,000)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.toolkit import chunk_text, utf16_units


def test_units_count_astral_characters_twice() -> None:
    assert utf16_units("a😀é") == 4
    assert utf16_units("") == 0


def test_chunks_never_split_a_pair() -> None:
    assert chunk_text("ab😀c", 2) == ["ab", "😀", "c"]
    assert chunk_text("", 5) == []
    with pytest.raises(ValueError):
        chunk_text("x", 1)


@given(st.text(max_size=3000), st.integers(min_value=2, max_value=500))
@settings(max_examples=60, deadline=None)
def test_chunks_rebuild_the_text_within_the_budget(text: str, limit: int) -> None:
    chunks = chunk_text(text, limit)
    assert "".join(chunks) == text
    assert all(0 < utf16_units(c) <= limit for c in chunks)

"""The common-case shortcuts of ``stores._bases`` against the full checks they skip.

``check_save`` recognises the usual save (ASCII names, exact ints, an exact scope) in one
expression and skips the per-field checks; the journal's small metadata dicts are encoded
once. Both must be invisible: every value the shortcut accepts, the full checks accept too,
and the bytes stored are the ones the full path would store.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stores import InvalidCheckpointError, OwnershipScope, SaveCheckpoint, _bases, _types

TEXT = st.one_of(
    st.text(max_size=6),
    st.sampled_from(["", "a", "é", "\ud800", "ns", "key:1"]),
)
ANY = st.one_of(
    st.none(),
    TEXT,
    st.booleans(),
    st.integers(min_value=-2, max_value=2**53 + 1),
    st.sampled_from([2**53 - 1, 2**53, 1.0, b"ns"]),
)
SCOPES = st.one_of(
    st.builds(OwnershipScope, st.none() | TEXT, st.none() | TEXT, st.none() | TEXT),
    st.sampled_from(
        [
            None,
            "scope",
            ("t", "a", "u"),
            OwnershipScope("\ud800", "a", "u"),
            OwnershipScope("t", "\ud800", "u"),
            OwnershipScope("t", "a", "\ud800"),
            OwnershipScope("t", "é", None),
            OwnershipScope(5, None, None),  # type: ignore[arg-type]  # a bad scope field
            OwnershipScope(None, None, b"u"),  # type: ignore[arg-type]  # a bad scope field
        ]
    ),
)


def _full_checks(**fields: Any) -> bool:
    """The per-field checks of ``check_save`` alone: True when they accept the fields."""
    try:
        _bases.check_checkpoint_address(fields["namespace"], fields["key"], fields["scope"])
    except InvalidCheckpointError:
        return False
    if not _types._is_safe_int(fields["version"], 1):
        return False
    for name in ("expected_version", "fencing_token"):
        value = fields[name]
        if value is not None and not _types._is_safe_int(value, 0):
            return False
    category = fields["category"]
    return category is None or _types._is_text(category)


VALID = {
    "namespace": st.sampled_from(["ns", "prism.channels.v1.operation"]),
    "key": st.sampled_from(["k", "op:c:t:a:u:0123"]),
    "scope": st.builds(
        OwnershipScope,
        st.sampled_from([None, "t"]),
        st.sampled_from([None, "a"]),
        st.sampled_from([None, "u"]),
    ),
    "version": st.integers(min_value=1, max_value=2**53 - 1),
    "expected_version": st.none() | st.integers(min_value=0, max_value=2**53 - 1),
    "fencing_token": st.none() | st.integers(min_value=0, max_value=2**53 - 1),
    "category": st.none() | st.sampled_from(["c", "prism.channels.v1.operation.open"]),
}


@settings(max_examples=3000, deadline=None, database=None)
@given(data=st.data(), odd=st.sampled_from(sorted(VALID)))
def test_the_shortcut_accepts_only_what_the_full_checks_accept(
    data: st.DataObject, odd: str
) -> None:
    # Every field valid but one, which may be anything: each field's own edge cases meet
    # the shortcut with the others passing (all-random fields would almost never do).
    fields = {name: data.draw(strategy) for name, strategy in VALID.items()}
    fields[odd] = data.draw(SCOPES if odd == "scope" else ANY)
    if _bases._plain_save(**fields):
        assert _full_checks(**fields)


@pytest.mark.parametrize(
    "fields",
    [
        {"namespace": "", "key": "k"},
        {"namespace": "n", "key": "k\ud800"},
        {"version": True},
        {"version": 0},
        {"expected_version": 2**53},
        {"fencing_token": -1},
        {"category": 7},
        {"scope": OwnershipScope("t", 5, None)},  # type: ignore[arg-type]  # a bad scope field
    ],
)
def test_a_save_the_shortcut_declines_still_gets_the_full_checks_error(
    fields: dict[str, Any],
) -> None:
    save: dict[str, Any] = {
        "namespace": "n",
        "key": "k",
        "scope": OwnershipScope("t", "a", "u"),
        "version": 1,
        "value": {},
        "expected_version": None,
        "fencing_token": None,
        "category": None,
        "metadata": None,
    }
    save.update(fields)
    with pytest.raises(InvalidCheckpointError):
        _bases.check_writes((SaveCheckpoint(**save),), False, 1 << 20)


@settings(max_examples=500, deadline=None, database=None)
@given(st.dictionaries(TEXT, TEXT | st.integers(), max_size=5))
def test_metadata_is_stored_as_the_full_encoding_would_store_it(metadata: dict[str, Any]) -> None:
    try:
        expected: str | None = _types.encode_json(dict(metadata), "metadata")
    except InvalidCheckpointError:
        expected = None
    for _ in range(2):  # the first call may fill the memo, the second reads it
        try:
            got: str | None = _bases._metadata_json(metadata)
        except InvalidCheckpointError:
            got = None
        assert got == expected


def test_the_metadata_memo_is_bounded() -> None:
    for i in range(_bases._METADATA_JSON_MAX * 2):
        _bases._metadata_json({"kind": "k", "state": f"s{i}"})
    assert len(_bases._METADATA_JSON) <= _bases._METADATA_JSON_MAX
    assert _bases._metadata_json({"kind": "k", "state": "s-new"}) == '{"kind":"k","state":"s-new"}'


def test_large_metadata_is_encoded_every_time_not_remembered() -> None:
    before = dict(_bases._METADATA_JSON)
    text = "x" * (_bases._METADATA_MEMO_CHARS + 1)
    assert _bases._metadata_json({"note": text}) == '{"note":"' + text + '"}'
    remembered = dict(_bases._METADATA_JSON)
    assert remembered == before

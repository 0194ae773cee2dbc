"""signal-cli notifications → events or deliberate ignores (contract §12.3, §4).

Every sample in ``tests/fixtures/signal-cli`` (real captures and derived shapes, provenance
in ``tests/fixtures/SOURCES.md``) maps to the right event or ignore reason, in the manual,
automatic and pre-0.12 notification shapes. Shapes the fixtures lack (the pre-0.12 inline
``subscription``, a manual-mode decryption failure, receipts, typing, reactions, edits, …)
are built here from ``protocols-telegram-signal.md`` §2 and marked DERIVED.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.signal import IGNORE_REASONS, event_id_for
from adapters.signal._parse import Notification, Parsed, parse_envelope, read_notification
from tests.fakes.signal_cli import SENDER_UUID, other_envelope, text_envelope

from .conftest import CONN, SG_FIXTURES, fixture

NOW = 1_700_000_000_123


def parse(params: Any, *, account: str = "+15550000000", allow_groups: bool = False) -> Parsed:
    note = read_notification(params)
    assert note is not None, params
    return parse_envelope(
        note, connection_id=CONN, account=account, allow_groups=allow_groups, received_at_ms=NOW
    )


def expected_id(account: str, sender: str, device: int, env_ts: int, data_ts: int) -> str:
    """Contract §4, computed independently of the adapter."""
    raw = "\0".join([CONN, account, sender, str(device), str(env_ts), str(data_ts)]).encode()
    return base64.urlsafe_b64encode(hashlib.sha256(raw).digest()).decode().rstrip("=")


# --------------------------------------------------------------------------- the samples


def test_every_sample_is_covered_here() -> None:
    names = sorted(p.name for p in SG_FIXTURES.glob("sg*.json"))
    assert names == sorted(SAMPLES), "a new sample needs its expectation below"


def _sg01() -> None:
    """Man page, automatic mode, no ``account``: a text from a sender whose ``sourceUuid``
    is the placeholder ``"uuid"`` (not a UUID), so the number is the sender."""
    params = fixture("sg01_manpage_auto_mode_dataMessage.json")["params"]
    note = read_notification(params)
    assert note == Notification(
        shape="automatic", subscription=None, account=None, envelope=params["envelope"]
    )
    event = parse(params, account="+33123456789").event
    assert event is not None
    assert (event.text, event.external_actor_id, event.external_conversation_id) == (
        "foobar",
        "+33123456789",
        "+33123456789",
    )
    assert event.event_id == expected_id(
        "+33123456789", "+33123456789", 1, 1631458508784, 1631458508784
    )
    assert event.claims == {"platform": "signal", "messageType": "direct_text"}
    assert event.received_at_ms == NOW and event.connection_id == CONN


def _sg02() -> None:
    """Man page, manual subscription 0: a sync message (our own other device) is ignored."""
    params = fixture("sg02_manpage_manual_subscription_syncMessage_sent.json")["params"]
    note = read_notification(params)
    assert note is not None
    assert (note.shape, note.subscription, note.account) == ("manual", 0, "+33123456789")
    assert parse(params, account="+33123456789") == Parsed(ignored="sync")


def _sg03() -> None:
    """Request/response examples, not notifications: checked against the fake and the
    result mapping in ``test_fake.py`` and ``test_send.py``."""
    data = fixture("sg03_rpc_request_response_examples.json")
    assert read_notification(data["subscribeReceive"]["response"]) is None


def _sg06() -> None:
    """2021 text: ``sourceUuid`` ``"UUID"`` is no UUID, the number is the sender."""
    params = fixture("sg06_2021_text_only.json")["params"]
    event = parse(params).event
    assert event is not None
    assert (event.text, event.external_actor_id) == ("hello", "+0000000000")
    assert event.event_id == expected_id(
        "+15550000000", "+0000000000", 3, 1635213315943, 1635213315943
    )


def _sg08() -> None:
    """Two attachments and no text: refused by the attachment policy."""
    assert parse(fixture("sg08_2021_attachments_video_and_image_no_text.json")["params"]) == Parsed(
        ignored="attachment"
    )


def _sg10() -> None:
    """Decryption failure with the pre-0.10.4 ``error`` field and an envelope of nulls."""
    params = fixture("sg10_2021_decrypt_failure_old_error_field.json")["params"]
    note = read_notification(params)
    assert note is not None and note.decryption_failed and note.shape == "automatic"
    assert parse(params) == Parsed(ignored="decryption_failure")


def _sg13() -> None:
    """2026 ``params`` (automatic shape with ``account``): a sync message with an attachment."""
    params = fixture("sg13_2026_params_syncMessage_sent_with_attachment.json")
    note = read_notification(params)
    assert note is not None and (note.shape, note.account) == ("automatic", "+17032205356")
    assert parse(params, account="+17032205356") == Parsed(ignored="sync")


def _sg21() -> None:
    """0.14 manual group message with a document: a group (refused without
    ``allow_groups``), and with it still refused for its attachment."""
    params = fixture("sg21_DERIVED_v0.14_manual_incoming_group_attachment.json")["params"]
    assert parse(params) == Parsed(ignored="group")
    assert parse(params, allow_groups=True) == Parsed(ignored="attachment")


SAMPLES = {
    "sg01_manpage_auto_mode_dataMessage.json": _sg01,
    "sg02_manpage_manual_subscription_syncMessage_sent.json": _sg02,
    "sg03_rpc_request_response_examples.json": _sg03,
    "sg06_2021_text_only.json": _sg06,
    "sg08_2021_attachments_video_and_image_no_text.json": _sg08,
    "sg10_2021_decrypt_failure_old_error_field.json": _sg10,
    "sg13_2026_params_syncMessage_sent_with_attachment.json": _sg13,
    "sg21_DERIVED_v0.14_manual_incoming_group_attachment.json": _sg21,
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_sample(name: str) -> None:
    SAMPLES[name]()


# --------------------------------------------------------------------------- shapes


def test_the_three_shapes_carry_the_same_event() -> None:
    """DERIVED: one envelope as 0.12+ manual, pre-0.12 (inline ``subscription``) and
    automatic params: the same event each time (the receiver filters by shape later)."""
    envelope = text_envelope("hi there")
    shapes = {
        "manual": {"subscription": 4, "result": {"envelope": envelope, "account": "+15550000000"}},
        "legacy": {"envelope": envelope, "account": "+15550000000", "subscription": 4},
        "automatic": {"envelope": envelope, "account": "+15550000000"},
    }
    events = []
    for shape, params in shapes.items():
        note = read_notification(params)
        assert note is not None and note.shape == shape
        assert note.subscription == (None if shape == "automatic" else 4)
        events.append(parse(params).event)
    assert events[0] is not None and events[0] == events[1] == events[2]
    assert events[0].external_actor_id == SENDER_UUID


def test_a_manual_decryption_failure_is_ignored() -> None:
    """DERIVED: 0.10.4+ names the failure ``exception``; in manual mode it sits in ``result``."""
    params = {
        "subscription": 0,
        "result": {
            "envelope": {"source": None, "sourceDevice": None, "timestamp": 1},
            "account": "+15550000000",
            "exception": {
                "message": "decryption failed",
                "type": "ProtocolInvalidMessageException",
            },
        },
    }
    assert parse(params) == Parsed(ignored="decryption_failure")


@pytest.mark.parametrize(
    "params",
    [
        None,
        [],
        "receive",
        {},
        {"subscription": 0},
        {"subscription": -1, "result": {"envelope": {}}},
        {"subscription": "0", "result": {"envelope": {}}},
        {"subscription": True, "result": {"envelope": {}}},
        {"envelope": "x"},
        {"subscription": 0, "result": {"envelope": None}},
    ],
)
def test_unreadable_params_are_none(params: Any) -> None:
    assert read_notification(params) is None


# --------------------------------------------------------------------------- content kinds


def manual(envelope: dict[str, Any], account: str = "+15550000000") -> dict[str, Any]:
    return {"subscription": 0, "result": {"envelope": envelope, "account": account}}


@pytest.mark.parametrize(
    ("envelope", "reason"),
    [
        (
            other_envelope(
                "receiptMessage",
                {
                    "when": 1,
                    "isDelivery": True,
                    "isRead": False,
                    "isViewed": False,
                    "timestamps": [1],
                },
            ),
            "receipt",
        ),
        (
            other_envelope(
                "typingMessage", {"action": "STARTED", "timestamp": 1, "groupId": "Z3JvdXA="}
            ),
            "typing",
        ),
        (other_envelope("syncMessage", {}), "sync"),
        (other_envelope("callMessage", {"offerMessage": {"id": 1}}), "call"),
        (other_envelope("storyMessage", {"allowsReplies": True}), "story"),
        (
            other_envelope(
                "editMessage", {"targetSentTimestamp": 1, "dataMessage": {"message": "x"}}
            ),
            "edit",
        ),
        ({"source": "+15551234567", "sourceDevice": 1, "timestamp": 5}, "no_content"),
        (
            text_envelope(
                None,
                reaction={
                    "emoji": "👍",
                    "targetAuthor": "+1",
                    "targetSentTimestamp": 1,
                    "isRemove": False,
                },
            ),
            "reaction",
        ),
        (text_envelope(None, remoteDelete={"timestamp": 1}), "remote_delete"),
        (text_envelope(None, sticker={"packId": "ab", "stickerId": 1}), "sticker"),
        (text_envelope(None, isExpirationUpdate=True, expiresInSeconds=3600), "expiration_update"),
        (text_envelope("x", groupInfo={"groupId": "Z3JvdXA=", "type": "UPDATE"}), "group_update"),
        (
            text_envelope("hello group", groupInfo={"groupId": "Z3JvdXA=", "type": "DELIVER"}),
            "group",
        ),
        (
            text_envelope(
                "voice",
                attachments=[
                    {
                        "contentType": "audio/aac",
                        "filename": None,
                        "id": "a.aac",
                        "size": 9,
                        "voiceNote": True,
                    }
                ],
            ),
            "attachment",
        ),
        (text_envelope("card", contacts=[{"name": {"given": "Bob"}}]), "contact"),
        (text_envelope(None), "no_text"),
        (text_envelope(""), "empty"),
        (text_envelope(" \n\t"), "empty"),
        (text_envelope("x", attachments="nope"), "malformed"),
        (text_envelope("x", groupInfo="nope"), "malformed"),
        (text_envelope("no sender", uuid=None, number=None), "malformed"),
        (text_envelope("bad uuid", uuid="not-a-uuid", number="15551234567"), "malformed"),
        (text_envelope("device", device=-1), "malformed"),
        (text_envelope("ts", timestamp=-5), "malformed"),
    ],
)
def test_content_kinds(envelope: dict[str, Any], reason: str) -> None:
    """DERIVED shapes of every other content: each ignored with its own reason."""
    assert parse(manual(envelope)) == Parsed(ignored=reason)
    assert reason in IGNORE_REASONS


def test_groups_with_allow_groups_become_group_events() -> None:
    params = manual(
        text_envelope(
            "hello group",
            groupInfo={"groupId": "iJKE+/=", "type": "DELIVER", "groupName": "G", "revision": 3},
        )
    )
    event = parse(params, allow_groups=True).event
    assert event is not None
    assert event.external_conversation_id == "group:iJKE+/="
    assert event.external_actor_id == SENDER_UUID
    assert event.claims["messageType"] == "group_text"
    bad_id = manual(text_envelope("x", groupInfo={"groupId": "has space", "type": "DELIVER"}))
    assert parse(bad_id, allow_groups=True) == Parsed(ignored="malformed")


def test_sender_is_the_aci_when_present_else_the_number() -> None:
    upper = SENDER_UUID.upper()
    assert parse(manual(text_envelope("a", uuid=upper))).event.external_actor_id == SENDER_UUID  # type: ignore[union-attr]
    # an ACI-only sender (no number known): ``source`` holds the UUID too
    aci_only = text_envelope("b", uuid=SENDER_UUID, number=None)
    assert aci_only["source"] == SENDER_UUID
    assert parse(manual(aci_only)).event.external_actor_id == SENDER_UUID  # type: ignore[union-attr]
    # no ACI: the number
    number_only = text_envelope("c", uuid=None, number="+15551234567")
    assert parse(manual(number_only)).event.external_actor_id == "+15551234567"  # type: ignore[union-attr]
    # only the deprecated ``source``
    legacy = {
        "source": "+4915112345678",
        "sourceDevice": 2,
        "timestamp": 9,
        "dataMessage": {"message": "d"},
    }
    assert parse(manual(legacy)).event.external_actor_id == "+4915112345678"  # type: ignore[union-attr]


def test_event_ids_follow_the_contract_and_deduplicate() -> None:
    envelope = text_envelope("same", device=2, timestamp=111)
    envelope["dataMessage"]["timestamp"] = 222
    first = parse(manual(envelope)).event
    again = parse(manual(envelope)).event
    assert first is not None and again is not None
    assert first.event_id == again.event_id == expected_id("+15550000000", SENDER_UUID, 2, 111, 222)
    assert len(first.event_id) == 43
    assert event_id_for(
        connection_id=CONN,
        account="+15550000000",
        sender=SENDER_UUID,
        device=2,
        envelope_timestamp=111,
        message_timestamp=None,
    ) == expected_id("+15550000000", SENDER_UUID, 2, 111, 111)
    other_device = text_envelope("same", device=3, timestamp=111)
    other_device["dataMessage"]["timestamp"] = 222
    assert parse(manual(other_device)).event.event_id != first.event_id  # type: ignore[union-attr]


def test_text_keeps_mentions_quotes_and_replaces_lone_surrogates() -> None:
    mention = text_envelope(
        "\ufffc can you help?",
        mentions=[{"name": "+1", "number": "+1", "uuid": SENDER_UUID, "start": 0, "length": 1}],
        quote={"id": 1, "author": "+1", "text": "earlier", "attachments": []},
        previews=[],
    )
    assert parse(manual(mention)).event.text == "\ufffc can you help?"  # type: ignore[union-attr]
    broken = text_envelope("a\ud800b")
    assert parse(manual(broken)).event.text == "a\ufffdb"  # type: ignore[union-attr]


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**60), 2**60) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "envelope",
                    "dataMessage",
                    "message",
                    "sourceUuid",
                    "sourceNumber",
                    "source",
                    "sourceDevice",
                    "timestamp",
                    "groupInfo",
                    "groupId",
                    "type",
                    "attachments",
                    "subscription",
                    "result",
                    "account",
                    "exception",
                    "error",
                    "reaction",
                ]
            ),
            children,
            max_size=6,
        )
    ),
    max_leaves=25,
)


@given(_json)
@settings(max_examples=300, deadline=None)
def test_any_params_parse_without_raising(params: Any) -> None:
    note = read_notification(params)
    if note is None:
        return
    for allow in (False, True):
        result = parse_envelope(
            note, connection_id=CONN, account="+1", allow_groups=allow, received_at_ms=NOW
        )
        assert (result.event is None) != (result.ignored is None)
        assert result.ignored is None or result.ignored in IGNORE_REASONS

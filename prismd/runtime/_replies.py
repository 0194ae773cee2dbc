"""Reply records that always fit the journal (contract §5 record cap, §9.2 persist before send)."""

from __future__ import annotations

import json

import attrs

from ..journal import ReplyRecord
from ..redact import truncate_utf8, utf8_len


def scrub_surrogates(text: str) -> str:
    """``text`` with lone surrogates replaced by U+FFFD (a surrogate pair held as two
    code points becomes its character): the journal stores UTF-8, which has no encoding
    for a lone surrogate, and a reply that cannot be staged would be lost."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def _record_size(record: ReplyRecord, text: str) -> int:
    value = attrs.evolve(record, text=text).to_json()
    dumped = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return utf8_len(dumped)


def fit_record(record: ReplyRecord, max_journal_record_bytes: int) -> ReplyRecord:
    """``record``, its text cut further (with the truncation marker) when its JSON would
    not fit ``max_journal_record_bytes`` with room left for marking it (message id and a
    reason of up to 512 bytes, escaped). JSON escaping can grow a text six-fold, and a
    record that cannot be staged would lose the answer. Returns ``record`` itself when
    it already fits.
    """
    limit = max(1024, max_journal_record_bytes)
    budget = limit - min(4096, limit // 4)
    if _record_size(record, record.text) <= budget:
        return record
    lo, hi = 0, utf8_len(record.text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _record_size(record, truncate_utf8(record.text, mid)[0]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return attrs.evolve(record, text=truncate_utf8(record.text, lo)[0])

"""A journal that is not the one we had is refused (issue 10): the journal holds a random
id from its first start, the state directory remembers it, and a zero-length, replaced or
missing journal stops the daemon with a clear message instead of starting afresh with
every dedup record gone — unless `prismd run --accept-new-journal` adopts it."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

from .helpers import Layout, running_daemon, write_config

pytestmark = pytest.mark.slow


def _replace_journal(layout: Layout, source: Path | None) -> None:
    """Put ``source``'s journal in place of ``layout``'s (``None``: leave the file as the
    caller left it), dropping the old journal's WAL and shared-memory files."""
    if source is not None:
        shutil.copy(source, layout.db)
    for suffix in ("-wal", "-shm"):
        Path(str(layout.db) + suffix).unlink(missing_ok=True)


def _damage(layout: Layout, how: str) -> None:
    if how == "truncate":
        layout.db.write_bytes(b"")
    else:
        layout.db.unlink()
    _replace_journal(layout, None)


async def _start_and_stop(layout: Layout, tag: str, *args: str) -> tuple[int, str]:
    async with running_daemon(layout, tag=tag, args=args) as daemon:
        for state in ("READY=1",):
            try:
                await daemon.wait_state(state, limit_s=30)
            except AssertionError:
                return await daemon.wait_exit(), daemon.stderr()
        daemon.send(signal.SIGTERM)
        return await daemon.wait_exit(), daemon.stderr()


async def test_a_replaced_or_emptied_journal_is_refused_unless_adopted(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    layout = write_config(tmp_path / "a")
    code, log = await _start_and_stop(layout, "first")
    assert code == 0, log
    remembered = (layout.state_dir / "journal-id").read_text().strip()
    assert len(remembered) == 32
    # The same journal again: fine.
    code, log = await _start_and_stop(layout, "same")
    assert code == 0, log

    # Another daemon's journal put in its place.
    other = write_config(tmp_path / "b")
    code, log = await _start_and_stop(other, "other")
    assert code == 0, log
    _replace_journal(layout, other.db)
    code, log = await _start_and_stop(layout, "replaced")
    assert code == 1
    assert "is not the one this daemon ran on before" in log
    assert "--accept-new-journal" in log
    assert log.count("prismd:") == 1  # printed once

    # Emptied (zero length), then missing: refused the same way.
    for damage in ("truncate", "remove"):
        _damage(layout, damage)
        code, log = await _start_and_stop(layout, damage)
        assert code == 1, (damage, log)
        assert "is not the one this daemon ran on before" in log

    # Adopted explicitly: it starts (with a warning), and from then on it is the journal.
    code, log = await _start_and_stop(layout, "adopt", "--accept-new-journal")
    assert code == 0, log
    assert "adopting a new journal" in log
    assert (layout.state_dir / "journal-id").read_text().strip() != remembered
    code, log = await _start_and_stop(layout, "after")
    assert code == 0, log

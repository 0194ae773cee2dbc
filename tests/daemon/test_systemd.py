"""The systemd unit, sysusers/tmpfiles snippets and the example config, checked by systemd."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from prismd.daemon._config import load_config
from prismd.limits import Limits
from tests.support.privileges import needs_root

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"
UNIT = SYSTEMD / "prismd.service"
ANALYZE = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"


def unit_directives() -> dict[str, list[str]]:
    """``Key`` → every value it has in the unit (keys may repeat)."""
    values: dict[str, list[str]] = {}
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        values.setdefault(key, []).append(value)
    return values


def verify(unit_dir: Path, name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ANALYZE, "verify", "--man=no", str(unit_dir / name)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def installable_copy(tmp_path: Path, text: str | None = None) -> Path:
    """The unit with ExecStart pointing at a real executable (the venv's prismd if present).

    ``systemd-analyze verify`` refuses a unit whose command does not exist; nothing is
    installed system-wide here.
    """
    executable = Path(sys.executable).parent / "prismd"
    if not executable.is_file():
        executable = tmp_path / "prismd"
        executable.write_text("#!/bin/sh\nexit 0\n")
        executable.chmod(0o755)
    text = UNIT.read_text() if text is None else text
    installed = text.replace("/opt/prismd/bin/prismd", str(executable))
    (tmp_path / "prismd.service").write_text(installed)
    return tmp_path


def test_systemd_analyze_verify_passes(tmp_path: Path) -> None:
    result = verify(installable_copy(tmp_path), "prismd.service")
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", "no warnings either"


def test_verify_would_catch_a_broken_unit(tmp_path: Path) -> None:
    # The check above is meaningful: a typo or a bad value produces output.
    broken = UNIT.read_text().replace("WatchdogSec=30", "WatchdogSec=thirty\nWatchdogSecs=30")
    result = verify(installable_copy(tmp_path, broken), "prismd.service")
    assert "WatchdogSecs" in result.stderr
    assert "thirty" in result.stderr or "Failed to parse" in result.stderr


def test_unit_directives() -> None:
    d = unit_directives()
    assert d["Type"] == ["notify"]
    assert d["ExecStart"] == ["/opt/prismd/bin/prismd run --config /etc/prismd/prismd.toml"]
    assert d["WatchdogSec"] == ["30"]
    stop_s = int(d["TimeoutStopSec"][0])
    assert stop_s * 1000 > Limits().stop_deadline_ms, "TimeoutStopSec above the stop deadline"
    assert d["StateDirectory"] == ["prismd"]
    assert d["RuntimeDirectory"] == ["prismd"]
    assert d["RuntimeDirectoryMode"] == ["0750"]
    assert "LoadCredential" not in d, "a drop-in (prismd.service.d/telegram.conf) holds it"
    assert d["ProtectSystem"] == ["strict"]
    assert d["ProtectHome"] == ["yes"]
    assert d["PrivateTmp"] == ["yes"]
    assert d["NoNewPrivileges"] == ["yes"]
    assert "@system-service" in d["SystemCallFilter"]
    assert d["User"] == ["prismd"]
    assert d["Group"] == ["prismd"]
    assert d["SupplementaryGroups"] == ["prismd-operators"]
    assert d["Restart"] == ["on-failure"]
    assert d["Environment"].count("PRISMD_CONTROL_SOCKET=/run/prismd/control.sock") == 1


def test_unit_is_well_sandboxed(tmp_path: Path) -> None:
    result = subprocess.run(
        [ANALYZE, "security", "--offline=yes", str(installable_copy(tmp_path) / "prismd.service")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    last = result.stdout.strip().splitlines()[-1]
    assert "Overall exposure level" in last, result.stdout + result.stderr
    level = float(last.split(":")[1].split()[0])
    assert level <= 2.0, last


def sysusers(root: Path) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Apply the sysusers snippet to an empty ``root``: its passwd and group, by name."""
    (root / "etc").mkdir(parents=True)
    result = subprocess.run(
        ["systemd-sysusers", f"--root={root}", str(SYSTEMD / "prismd.sysusers.conf")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    passwd = {
        line.split(":")[0]: line.split(":")
        for line in (root / "etc/passwd").read_text().splitlines()
    }
    groups = {
        line.split(":")[0]: line.split(":")
        for line in (root / "etc/group").read_text().splitlines()
    }
    return passwd, groups


def test_sysusers_snippet(tmp_path: Path) -> None:
    passwd, groups = sysusers(tmp_path / "root")
    assert passwd["prismd"][5:] == ["/var/lib/prismd", "/usr/sbin/nologin"]
    assert "prismd" in groups
    assert groups["prismd-operators"][3].split(",") == ["prismd"]


@needs_root("systemd-tmpfiles chowns the directories to the prismd user")
def test_tmpfiles_snippet(tmp_path: Path) -> None:
    root = tmp_path / "root"
    passwd, groups = sysusers(root)
    tmpfiles = subprocess.run(
        ["systemd-tmpfiles", f"--root={root}", "--create", str(SYSTEMD / "prismd.tmpfiles.conf")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert tmpfiles.returncode == 0, tmpfiles.stderr
    uid, gid = int(passwd["prismd"][2]), int(groups["prismd"][2])
    etc = (root / "etc/prismd").stat()
    assert (etc.st_mode & 0o777, etc.st_uid, etc.st_gid) == (0o750, 0, gid)
    state = (root / "var/lib/prismd").stat()
    assert (state.st_mode & 0o777, state.st_uid, state.st_gid) == (0o750, uid, gid)


def test_example_config_is_valid_and_matches_the_unit() -> None:
    config = load_config(SYSTEMD / "prismd.example.toml", env={})
    assert config.control.socket == "/run/prismd/control.sock"
    assert config.control.group == "prismd-operators"
    assert config.daemon.state_dir == "/var/lib/prismd"
    assert config.store.url == "sqlite:////var/lib/prismd/journal.sqlite"
    stop_s = int(unit_directives()["TimeoutStopSec"][0])
    assert config.limits.stop_deadline_ms < stop_s * 1000
    telegram = config.connection("tg-main")
    assert telegram is not None
    # The token file is the unit's credential name, found through $CREDENTIALS_DIRECTORY.
    assert getattr(telegram, "token_file", None) == "telegram-token"
    assert {c.kind for c in config.connections} == {"telegram", "webchat"}


def _syscall_set(name: str, seen: set[str] | None = None) -> set[str]:
    """Every syscall of ``name`` (a syscall or an ``@group``, expanded by systemd-analyze)."""
    if not name.startswith("@"):
        return {name}
    seen = set() if seen is None else seen
    if name in seen:
        return set()
    seen.add(name)
    out = subprocess.run(
        [ANALYZE, "syscall-filter", "--no-pager", name],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    result: set[str] = set()
    for line in out.splitlines()[1:]:
        item = line.strip()
        if item and not item.startswith("#"):
            result |= _syscall_set(item, seen)
    return result


def _allowed_syscalls() -> set[str]:
    """The unit's allow list, evaluated like systemd: left to right, ``~`` removes."""
    allowed: set[str] = set()
    for value in unit_directives()["SystemCallFilter"]:
        deny = value.startswith("~")
        for item in value.removeprefix("~").split():
            names = _syscall_set(item)
            allowed = allowed - names if deny else allowed | names
    return allowed


def test_syscall_filter_allows_what_the_daemon_calls() -> None:
    """With ``[control] group`` (set in the example config) the daemon chowns the socket and
    its directory to the operators group. ``~@privileged`` contains ``@chown``, so under the
    shipped unit that start-up step failed with EPERM; the unit must allow it again."""
    config = load_config(SYSTEMD / "prismd.example.toml", env={})
    assert config.control.group is not None
    allowed = _allowed_syscalls()
    for name in ("chown", "fchown", "fchownat", "chmod", "fchmodat", "umask", "flock"):
        assert name in allowed, name
    for name in ("setuid", "reboot", "init_module", "setrlimit"):
        assert name not in allowed, name

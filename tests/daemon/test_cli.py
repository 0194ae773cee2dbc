"""`prismd check-config` and CLI usage, in-process and as a real subprocess."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from prismd.cli._prismd import main

pytestmark = pytest.mark.slow  # real subprocesses, servers or a browser

REPO = Path(__file__).resolve().parents[2]

GOOD = """
[store]
url = "sqlite:///var/j.sqlite"

[[connections]]
id = "web"
kind = "webchat"
listen = "127.0.0.1:8787"

[agents.echo]
kind = "echo"

[agents.slow]
kind = "mock"
delay_ms = 10

[[grants]]
connection = "web"
actors = ["*"]
aliases = ["echo", "slow"]
"""


def test_check_config_ok_prints_a_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "prismd.toml"
    path.write_text(GOOD)
    assert main(["check-config", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok: ")
    assert "webchat web" in out
    assert "echo (echo)" in out and "slow (mock)" in out
    assert "1 grant(s)" in out
    assert "store: sqlite" in out
    assert "metrics" not in out
    path.write_text(GOOD + '\n[metrics]\nlisten = "127.0.0.1:9464"\n')
    assert main(["check-config", "--config", str(path)]) == 0
    assert "metrics on 127.0.0.1:9464" in capsys.readouterr().out


def test_check_config_bad_key_exits_1_naming_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(GOOD.replace('kind = "webchat"', 'kind = "webchat"\nbogus = 1'))
    assert main(["check-config", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert str(path) in err
    assert "bogus" in err


def test_check_config_missing_file_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.toml"
    assert main(["check-config", "--config", str(missing)]) == 1
    assert "file not found" in capsys.readouterr().err


def test_check_config_defaults_without_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TELEGRAM_BOT_TOKEN", raising=False)
    assert main(["check-config"]) == 0
    out = capsys.readouterr().out
    assert "built-in defaults" in out
    assert "webchat web" in out and "telegram" not in out


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["frobnicate"], ["run", "--log-level", "loud"], ["soak", "--lanes", "0"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    capsys.readouterr()


def test_check_config_as_a_subprocess(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(GOOD)
    bad = tmp_path / "bad.toml"
    bad.write_text("[limits]\nmax_routes = 0\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ok = subprocess.run(
        [sys.executable, "-m", "prismd", "check-config", "--config", str(good)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("ok: ")
    failed = subprocess.run(
        [sys.executable, "-m", "prismd", "check-config", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert failed.returncode == 1
    assert "max_routes" in failed.stderr


def test_run_with_a_bad_config_exits_1_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[connections]]\nid = "web"\nkind = "carrier-pigeon"\n')
    done = subprocess.run(
        [sys.executable, "-m", "prismd", "run", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=str(tmp_path),
    )
    assert done.returncode == 1
    assert "kind" in done.stderr and str(bad) in done.stderr
    assert not (tmp_path / "var").exists()


def test_run_with_a_missing_secret_exits_1_without_starting(tmp_path: Path) -> None:
    path = tmp_path / "tg.toml"
    path.write_text(
        f"""
[daemon]
state_dir = "{tmp_path / "state"}"
[store]
url = "sqlite:///{tmp_path / "j.sqlite"}"
[control]
socket = "{tmp_path / "run" / "c.sock"}"
[[connections]]
id = "tg"
kind = "telegram"
token_env = "PRISMD_TEST_MISSING_TOKEN"
[agents.echo]
kind = "echo"
[[grants]]
connection = "tg"
pairing = true
aliases = ["echo"]
"""
    )
    env = {k: v for k, v in os.environ.items() if k != "PRISMD_TEST_MISSING_TOKEN"}
    done = subprocess.run(
        [sys.executable, "-m", "prismd", "run", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "PYTHONPATH": str(REPO)},
        cwd=str(tmp_path),
    )
    assert done.returncode == 1, done.stderr
    assert "PRISMD_TEST_MISSING_TOKEN" in done.stderr
    assert not (tmp_path / "run" / "c.sock").exists()


def test_version_is_the_distributions_for_both_commands() -> None:
    """One source of truth: pyproject.toml's version, read from the installed metadata."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert importlib.metadata.version("prismd") == declared
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for module, prog in (("prismd", "prismd"), ("prismd.cli.prismctl", "prismctl")):
        done = subprocess.run(
            [sys.executable, "-m", module, "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"{prog} {declared}\n"

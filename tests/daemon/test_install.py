"""The documented install, run as docs/install.md writes it (into temporary PREFIX and DESTDIR),
then checked as an operator would: systemd verifies the installed unit, the installed
commands run from anywhere, the example config passes check-config with the environment it
documents."""

from __future__ import annotations

import grp
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from .helpers import REPO

pytestmark = pytest.mark.slow  # real subprocesses, servers or a browser

SYSTEMD = REPO / "systemd"
ANALYZE = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"
OPERATORS_GROUP = "prismd-operators"
SECRET = "123456:InstalledTokenValue-7f3a-abcdefghijklmnop"


def documented_install_commands() -> list[list[str]]:
    """The ``sudo make install…`` lines of docs/install.md's install block, without ``sudo``."""
    page = (REPO / "docs" / "install.md").read_text(encoding="utf-8")
    section = page.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, "the Install section of docs/install.md has no sh block"
    commands = []
    for line in block.group(1).splitlines():
        words = shlex.split(line, comments=True)
        if words[:3] in (["sudo", "make", "install"], ["sudo", "make", "install-telegram"]):
            commands.append(words[1:])
    return commands


@attrs.frozen
class Installed:
    prefix: Path
    destdir: Path

    @property
    def bindir(self) -> Path:
        return self.destdir / "usr/local/bin"

    @property
    def unitdir(self) -> Path:
        return self.destdir / "etc/systemd/system"


def clean_env() -> dict[str, str]:
    """The caller's environment without what would point the commands back at the checkout."""
    drop = {"PYTHONPATH", "VIRTUAL_ENV", "PREFIX", "DESTDIR", "BINDIR", "NOTIFY_SOCKET"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def make(args: list[str], installed: Installed) -> None:
    """Runs ``args`` into the temporary PREFIX and DESTDIR. Both lie in the temporary
    directory, which the unit's PrivateTmp=yes hides from the service: ALLOW_HIDDEN_PREFIX=yes
    says this staged install is not started from there."""
    done = subprocess.run(
        [
            *args,
            f"PREFIX={installed.prefix}",
            f"DESTDIR={installed.destdir}",
            "ALLOW_HIDDEN_PREFIX=yes",
        ],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """``make install`` only (not the Telegram drop-in), as docs/install.md says; once."""
    base = tmp_path_factory.mktemp("install")
    result = Installed(prefix=base / "opt" / "prismd", destdir=base / "root")
    commands = documented_install_commands()
    assert commands[0] == ["make", "install"], commands
    make(commands[0], result)
    return result


def verify(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ANALYZE, "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_docs_document_the_install_and_the_telegram_drop_in() -> None:
    assert documented_install_commands() == [["make", "install"], ["make", "install-telegram"]]


def test_the_installed_unit_runs_the_installed_prismd_and_verifies(installed: Installed) -> None:
    unit = installed.unitdir / "prismd.service"
    lines = unit.read_text().splitlines()
    exec_start = [line for line in lines if line.startswith("ExecStart=")]
    command = f"{installed.prefix}/bin/prismd run --config /etc/prismd/prismd.toml"
    assert exec_start == [f"ExecStart={command}"]
    # Without Telegram nothing asks for a credential file, so the unit starts without one.
    assert not any(line.startswith("LoadCredential") for line in lines)
    assert not (installed.unitdir / "prismd.service.d").exists()
    result = verify(unit)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", "no warnings either"
    # The unit shipped in the repository names the default PREFIX.
    shipped = (SYSTEMD / "prismd.service").read_text()
    assert "ExecStart=/opt/prismd/bin/prismd run --config /etc/prismd/prismd.toml" in shipped


def test_the_telegram_drop_in_installs_on_request_and_verifies(
    installed: Installed, tmp_path: Path
) -> None:
    staged = Installed(prefix=installed.prefix, destdir=tmp_path / "root")
    make(documented_install_commands()[1], staged)
    drop_in = staged.unitdir / "prismd.service.d" / "telegram.conf"
    assert "LoadCredential=telegram-token:/etc/prismd/telegram-token" in drop_in.read_text()
    assert not (staged.unitdir / "prismd.service").exists(), "only the drop-in"
    shutil.copy(installed.unitdir / "prismd.service", staged.unitdir / "prismd.service")
    result = verify(staged.unitdir / "prismd.service")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    # verify reads the drop-in (a typo in it is reported), so the clean result means something.
    drop_in.write_text(drop_in.read_text().replace("LoadCredential=", "LoadCredentia1="))
    assert "LoadCredentia1" in verify(staged.unitdir / "prismd.service").stderr


def test_the_snippets_are_where_sysusers_and_tmpfiles_look(installed: Installed) -> None:
    for tool, name in (("systemd-sysusers", "sysusers.d"), ("systemd-tmpfiles", "tmpfiles.d")):
        done = subprocess.run(
            [tool, f"--root={installed.destdir}", "--cat-config"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert f"/etc/{name}/prismd.conf" in done.stdout
        assert (SYSTEMD / f"prismd.{name.split('.')[0]}.conf").read_text() in done.stdout


def test_the_installed_commands_run_from_anywhere(installed: Installed, tmp_path: Path) -> None:
    """Not editable: the package is the venv's copy, and the links in BINDIR work."""
    env = clean_env()
    for name in ("prismd", "prismctl"):
        link = installed.bindir / name
        assert link.is_symlink() and link.resolve() == (installed.prefix / "bin" / name).resolve()
        done = subprocess.run(
            [str(link), "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=tmp_path,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert re.fullmatch(rf"{name} \d+\.\d+\.\d+\S*\n", done.stdout), done.stdout
    probe = "import prismd, adapters; print(prismd.__file__)"
    where = subprocess.run(
        [str(installed.prefix / "bin/python"), "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
        check=True,
    ).stdout
    assert where.startswith(str(installed.prefix)), where


async def test_the_installed_daemon_serves_the_web_chat_and_stops_cleanly(
    installed: Installed, tmp_path: Path
) -> None:
    config = tmp_path / "prismd.toml"
    config.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n'
        f'[store]\nurl = "sqlite:///{tmp_path / "journal.sqlite"}"\n'
        f'[control]\nsocket = "{tmp_path / "run" / "control.sock"}"\n'
        '[[connections]]\nid = "web"\nkind = "webchat"\nlisten = "127.0.0.1:0"\n'
        '[agents.echo]\nkind = "echo"\n'
        '[[grants]]\nconnection = "web"\nactors = ["*"]\naliases = ["echo"]\n'
    )
    err_path = tmp_path / "stderr"
    with err_path.open("wb") as err:
        process = await trio.lowlevel.open_process(
            [str(installed.bindir / "prismd"), "run", "--config", str(config)],
            stderr=err,
            env=clean_env(),
            cwd=str(tmp_path),
        )
    try:
        url = None
        with trio.fail_after(60):
            while url is None:
                assert process.returncode is None, err_path.read_text()
                found = re.search(r"web chat web: (http://\S+/)", err_path.read_text())
                url = found.group(1) if found else None
                await trio.sleep(0.05)
        async with httpx.AsyncClient(timeout=10) as client:
            page = await client.get(url)
        assert page.status_code == 200
        assert "<html" in page.text.lower(), "the page is packaged with the adapter"
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            assert await process.wait() == 0, err_path.read_text()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def _group_file_with_the_sysusers_groups(tmp_path: Path) -> Path:
    """/etc/group as systemd-sysusers writes it from the shipped snippet."""
    root = tmp_path / "sysroot"
    (root / "etc").mkdir(parents=True)
    subprocess.run(
        ["systemd-sysusers", f"--root={root}", str(SYSTEMD / "prismd.sysusers.conf")],
        capture_output=True,
        timeout=60,
        check=True,
    )
    return root / "etc" / "group"


def _namespaces_work() -> bool:
    probe = ["unshare", "--user", "--map-root-user", "--mount", "true"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_the_example_config_passes_check_config_with_the_env_it_documents(
    tmp_path: Path,
) -> None:
    """`CREDENTIALS_DIRECTORY=/etc/prismd prismd check-config …` after systemd-sysusers ran:
    here the credential directory is a temporary one, and the operators group comes from
    the shipped sysusers snippet, seen as /etc/group inside a private mount namespace
    (nothing on this machine changes)."""
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "telegram-token").write_text(SECRET + "\n")
    env = {**clean_env(), "PYTHONPATH": str(REPO), "CREDENTIALS_DIRECTORY": str(credentials)}
    command = [sys.executable, "-m", "prismd", "check-config", "systemd/prismd.example.toml"]
    try:
        grp.getgrnam(OPERATORS_GROUP)
        wrapped = command  # installed for real on this machine
    except KeyError:
        if not _namespaces_work():
            pytest.fail(
                f"group {OPERATORS_GROUP} does not exist and user+mount namespaces "
                "(unshare --user --map-root-user --mount) are not permitted here"
            )
        group_file = _group_file_with_the_sysusers_groups(tmp_path)
        wrapped = [
            "unshare",
            "--user",
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            'mount --bind "$0" /etc/group && exec "$@"',
            str(group_file),
            *command,
        ]
    done = subprocess.run(
        wrapped, capture_output=True, text=True, timeout=60, env=env, cwd=REPO, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok: systemd/prismd.example.toml: connections: telegram tg-main")
    assert SECRET not in done.stdout + done.stderr
    # The same check, without the credential it documents, is refused naming the key.
    env.pop("CREDENTIALS_DIRECTORY")
    refused = subprocess.run(
        wrapped, capture_output=True, text=True, timeout=60, env=env, cwd=REPO, check=False
    )
    assert refused.returncode == 1
    assert "[[connections]][1].token_file: secret file telegram-token not found" in refused.stderr


HIDDEN = ("/tmp", "/var/tmp", "/home", "/root", "/run/user")
"""What prismd.service's PrivateTmp=yes and ProtectHome=yes hide from the service."""


def run_make(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", *args],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_makefile_knows_what_the_unit_hides() -> None:
    unit = (SYSTEMD / "prismd.service").read_text().splitlines()
    assert "PrivateTmp=yes" in unit and "ProtectHome=yes" in unit
    makefile = (REPO / "Makefile").read_text()
    listed = re.search(r"^HIDDEN_BY_SANDBOX := (.*)$", makefile, re.M)
    assert listed is not None
    assert tuple(listed.group(1).split()) == HIDDEN


@pytest.mark.parametrize(
    "under", [*HIDDEN, "/opt/../tmp"], ids=["tmp", "var-tmp", "home", "root", "run-user", "dotdot"]
)
def test_make_install_refuses_a_prefix_the_sandbox_hides(under: str, tmp_path: Path) -> None:
    prefix = f"{under}/prismd-install-test-{os.getpid()}-{tmp_path.name}/prismd"
    destdir = tmp_path / "root"
    done = run_make("install", f"PREFIX={prefix}", f"DESTDIR={destdir}")
    assert done.returncode != 0
    hidden = os.path.normpath(under)
    assert f"PREFIX={prefix} is under {hidden}, which prismd.service" in done.stderr
    assert "ALLOW_HIDDEN_PREFIX=yes" in done.stderr and "/opt/prismd" in done.stderr
    # Refused before anything was made.
    assert not os.path.exists(os.path.dirname(os.path.normpath(prefix)))
    assert not destdir.exists()


def test_a_prefix_the_sandbox_shows_passes_and_the_override_warns() -> None:
    for prefix in ("/opt/prismd", "/srv/prismd", "/usr/local/lib/prismd", "/rooted/prismd"):
        done = run_make("check-prefix", f"PREFIX={prefix}")
        assert (done.returncode, done.stdout, done.stderr) == (0, "", ""), prefix
    staged = run_make("check-prefix", "PREFIX=/var/tmp/stage/prismd", "ALLOW_HIDDEN_PREFIX=yes")
    assert staged.returncode == 0
    assert staged.stderr.startswith("make install: warning: PREFIX=/var/tmp/stage/prismd is")
    assert "under /var/tmp" in staged.stderr and "installing anyway" in staged.stderr

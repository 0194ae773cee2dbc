"""``prismd init``: a starter config that passes check-config, runs and answers as written;
never over an existing file; secrets by variable name only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from prismd.cli._prismd import main
from tests.fakes.openai_api import start_fake_openai
from tests.fakes.telegram_api import start_fake

from .helpers import Layout, chat, child_env, free_port, running_daemon

TOKEN_ENV = {
    "TELEGRAM_BOT_TOKEN": "123456:secret-token",
    "OPENAI_API_KEY": "sk-FAKE-VALUE-42",
    "DISCORD_BOT_TOKEN": "discord-secret-token",
}


def _prismd(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prismd", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=child_env(**(env or {})),
    )


@pytest.mark.parametrize(
    ("flags", "kinds", "exports"),
    [
        ((), "webchat web", []),
        (("--telegram",), "webchat web, telegram telegram", ["TELEGRAM_BOT_TOKEN"]),
        (("--openai", "https://api.openai.com/v1"), "webchat web", ["OPENAI_API_KEY"]),
        (
            ("--telegram", "--openai", "http://127.0.0.1:8080/v1", "--model", "llama"),
            "webchat web, telegram telegram",
            ["TELEGRAM_BOT_TOKEN"],
        ),
        (("--discord",), "webchat web, discord discord", ["DISCORD_BOT_TOKEN"]),
    ],
)
def test_each_starter_config_passes_check_config(
    tmp_path: Path, flags: tuple[str, ...], kinds: str, exports: list[str]
) -> None:
    done = _prismd(tmp_path, "init", *flags)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    text = (tmp_path / "prismd.toml").read_text()
    for value in TOKEN_ENV.values():
        assert value not in text
    lines = done.stdout.splitlines()
    assert lines[:2] == ["wrote prismd.toml", "next:"]
    assert [line.split()[1].split("=")[0] for line in lines if "export " in line] == exports
    assert "  prismd run --config prismd.toml" in lines
    assert "then: open http://127.0.0.1:8787/ and say hello" in lines
    assert ("--telegram" in flags) == any("prismctl pair --connection telegram" in x for x in lines)
    assert ("--discord" in flags) == any("prismctl pair --connection discord" in x for x in lines)
    env = {name: TOKEN_ENV[name] for name in exports}
    checked = _prismd(tmp_path, "check-config", "prismd.toml", env=env)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith(f"ok: prismd.toml: connections: {kinds}; agents: ")
    agent = "assistant (openai)" if "--openai" in flags else "echo (echo)"
    assert f"agents: {agent};" in checked.stdout
    if exports:
        # Without the variables the next step names, check-config says which one is missing.
        missing = _prismd(tmp_path, "check-config", "prismd.toml")
        assert missing.returncode == 1
        assert f"environment variable {exports[0]} is not set" in missing.stderr


def test_init_never_overwrites(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mine.toml"
    path.write_text("# my own config\n")
    assert main(["init", "--telegram", "--path", str(path)]) == 1
    captured = capsys.readouterr()
    assert path.read_text() == "# my own config\n"
    assert captured.out == ""
    assert captured.err == (
        f"prismd init: {path} exists; it is not overwritten (move it away, or write another"
        " file with --path PATH)\n"
    )
    assert main(["init", "--path", str(tmp_path / "no-such-dir" / "x.toml")]) == 1
    assert "cannot write" in capsys.readouterr().err


def test_init_refuses_a_bad_model_url(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "prismd.toml"
    assert main(["init", "--openai", "http://models.example.com/v1", "--path", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("prismd init: --openai: ")
    assert "https://" in err
    assert not path.exists()


def test_a_mistyped_subcommand_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["int"])
    assert info.value.code == 2
    assert "invalid choice: 'int'" in capsys.readouterr().err.splitlines()[-1]
    with pytest.raises(SystemExit):
        main(["chek-config"])
    assert capsys.readouterr().err.endswith("; did you mean 'check-config'?\n")
    with pytest.raises(SystemExit):
        main(["zzzz"])
    assert "did you mean" not in capsys.readouterr().err


def _starter(tmp_path: Path, *flags: str) -> Layout:
    """``prismd init`` in ``tmp_path``, its web chat moved to a free port (and Telegram to a
    fake Bot API with ``api_origin``): the only edits a test on a shared machine needs."""
    done = _prismd(tmp_path, "init", *flags)
    assert done.returncode == 0, done.stderr
    layout = Layout(root=tmp_path, port=free_port())
    text = layout.config.read_text()
    assert 'listen = "127.0.0.1:8787"' in text
    layout.config.write_text(text.replace("127.0.0.1:8787", f"127.0.0.1:{layout.port}"))
    return layout


@pytest.mark.slow
async def test_the_web_chat_starter_answers_with_the_model(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        fake = await start_fake_openai(nursery, api_key=None)
        layout = _starter(tmp_path, "--openai", fake.base_url)
        async with running_daemon(layout) as daemon:
            await daemon.wait_state("READY=1")
            async with chat(layout.port, actor="starter-actor-01") as client:
                await client.send_message("m1", "hello")
                reply = await client.next_frame("reply")
            assert "You said: hello" in str(reply)
            daemon.send(15)
            assert await daemon.wait_exit() == 0, daemon.stderr()
        assert (tmp_path / "var" / "journal.sqlite").exists()
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_the_telegram_starter_answers_a_paired_user(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        fake = await start_fake(nursery)
        layout = _starter(tmp_path, "--telegram")
        text = layout.config.read_text()
        origin = '# api_origin = "https://api.telegram.org"'
        assert origin in text
        layout.config.write_text(text.replace(origin, f'api_origin = "{fake.origin}"'))
        env = {"TELEGRAM_BOT_TOKEN": fake.token}
        async with running_daemon(layout, extra_env=env) as daemon:
            await daemon.wait_state("READY=1")
            # No --socket: prismctl finds ./var/run/control.sock where the daemon runs.
            with trio.fail_after(30):
                done = await trio.run_process(
                    [sys.executable, "-m", "prismd.cli.prismctl", "--json", "pair",
                     "--connection", "telegram"],
                    capture_stdout=True, capture_stderr=True, check=False,
                    env=child_env(), cwd=str(tmp_path),
                )  # fmt: skip
            assert done.returncode == 0, done.stderr
            paired = json.loads(done.stdout)
            for number, text in enumerate((f"/pair {paired['token']}", "hello bot"), start=1):
                fake.push_update(
                    {
                        "message": {
                            "message_id": number,
                            "from": {"id": 202, "is_bot": False, "first_name": "Ada"},
                            "chat": {"id": 101, "type": "private", "first_name": "Ada"},
                            "date": 1_700_000_000,
                            "text": text,
                        }
                    }
                )
            with trio.fail_after(30):
                for _ in range(1_000_000):
                    if any(s.get("text") == "hello bot" for s in fake.sent):
                        break
                    await trio.sleep(0.05)
            daemon.send(15)
            assert await daemon.wait_exit() == 0, daemon.stderr()
            assert fake.token not in daemon.stderr()
        nursery.cancel_scope.cancel()


def test_the_socket_and_state_paths_are_relative_to_the_working_directory(tmp_path: Path) -> None:
    """The starter's paths are the ``make run`` ones, so prismctl finds its socket there."""
    assert _prismd(tmp_path, "init").returncode == 0
    text = (tmp_path / "prismd.toml").read_text()
    assert 'socket = "var/run/control.sock"' in text
    assert 'url = "sqlite:///var/journal.sqlite"' in text
    assert os.listdir(tmp_path) == ["prismd.toml"]


def test_the_next_steps_are_typed_as_this_prismd_was(tmp_path: Path) -> None:
    """In a clone after ``make run`` prismd is ``.venv/bin/prismd``, not on PATH: a bare
    ``prismd check-config`` in the next steps was "command not found"."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("prismd", "prismctl"):
        script = bin_dir / tool
        script.write_text(
            f"#!{sys.executable}\nimport sys\nfrom prismd.cli import main\nsys.exit(main())\n"
        )
        script.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()

    def init(path: str, search: str) -> list[str]:
        done = subprocess.run(
            ["../venv/bin/prismd", "init", "--telegram", "--path", path],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=work,
            env=child_env(PATH=search),
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    lines = init("a.toml", "/usr/bin:/bin")
    assert "  ../venv/bin/prismd check-config a.toml" in lines
    assert "  ../venv/bin/prismd run --config a.toml" in lines
    assert lines[-1].startswith("then: ../venv/bin/prismctl pair --connection telegram,")
    lines = init("b.toml", f"{bin_dir}:/usr/bin:/bin")  # found on PATH: typed by name
    assert "  prismd check-config b.toml" in lines
    assert lines[-1].startswith("then: prismctl pair --connection telegram,")


def test_a_model_url_without_v1_gets_a_note(tmp_path: Path) -> None:
    # Ollama's http://127.0.0.1:11434 (its API is under /v1) was written without a word;
    # every answer was then "the model server does not know this model or URL (HTTP 404)".
    done = _prismd(tmp_path, "init", "--openai", "http://127.0.0.1:11434", "--path", "a.toml")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == (
        "note: http://127.0.0.1:11434 does not end in /v1, where OpenAI, llama.cpp, vLLM and"
        " Ollama serve the API; if that is wrong, edit base_url (prismd doctor asks the server)"
    )
    assert 'base_url = "http://127.0.0.1:11434"' in (tmp_path / "a.toml").read_text()
    done = _prismd(tmp_path, "init", "--openai", "http://127.0.0.1:11434/v1/", "--path", "b.toml")
    assert done.returncode == 0 and "note:" not in done.stdout

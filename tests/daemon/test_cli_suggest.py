"""The command line's manners for a first try: a bare ``prismd``/``prismctl`` shows the
commands, and a mistyped option gets "did you mean" (``--confg`` was "unrecognized
arguments" alone)."""

from __future__ import annotations

import pytest

from prismd.cli import _prismd, prismctl


def _usage_error(main: object, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)  # type: ignore[operator]
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


def test_a_bare_command_shows_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(_prismd.main, [], capsys)
    assert "check-config" in err and "doctor" in err and "init" in err
    assert err.endswith("prismd: error: the following arguments are required: COMMAND\n")
    err = _usage_error(prismctl._main, [], capsys)
    assert "list-unresolved" in err and "reconcile" in err
    assert err.endswith("prismctl: error: the following arguments are required: COMMAND\n")


def test_a_mistyped_option_gets_did_you_mean(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(_prismd.main, ["run", "--confg", "x.toml"], capsys)
    assert err.endswith(
        "prismd: error: unrecognized arguments: --confg x.toml; did you mean '--config'?\n"
    )
    err = _usage_error(_prismd.main, ["doctor", "--confg=x.toml"], capsys)
    assert err.endswith("did you mean '--config'?\n")
    err = _usage_error(prismctl._main, ["health", "--jsn", "--sokcet=s"], capsys)
    assert err.endswith("did you mean '--json' for --jsn, '--socket' for --sokcet?\n")
    err = _usage_error(_prismd.main, ["run", "--zzz"], capsys)
    assert err.endswith("prismd: error: unrecognized arguments: --zzz\n")


def test_a_mistyped_required_option_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    # argparse reports it missing ("required: --connection"), never the word typed.
    argv = ["reconcile", "chan-op-1", "--conection", "tg", "--verison", "2"]
    err = _usage_error(prismctl._main, argv, capsys)
    assert err.endswith(
        "prismctl reconcile: error: the following arguments are required: --connection,"
        " --version (--conection is no option: '--connection'?, --verison is no option:"
        " '--version'?)\n"
    )
    err = _usage_error(prismctl._main, ["pair", "--conection=tg"], capsys)
    assert err.endswith("required: --connection (--conection is no option: '--connection'?)\n")
    err = _usage_error(prismctl._main, ["reconcile", "chan-op-1"], capsys)
    assert err.endswith("required: --connection, --version\n")

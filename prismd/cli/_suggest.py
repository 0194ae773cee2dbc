"""``did you mean …`` for the command line: an argparse parser whose invalid-choice error
names the closest choice (a mistyped subcommand, ``--log-level`` value …).

Standard library only: ``prismctl`` uses it too.
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Iterable
from typing import NoReturn

_INVALID_CHOICE = re.compile(r"invalid choice: '?([^'\s]+)'?")


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``word`` (difflib's ratio at least 0.6), or ``None``."""
    found = difflib.get_close_matches(word, sorted(set(candidates)), n=1, cutoff=0.6)
    return found[0] if found else None


class SuggestingParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` (subparsers inherit the class) whose
    invalid-choice errors end with ``did you mean 'x'?`` when a choice is close."""

    def error(self, message: str) -> NoReturn:
        match = _INVALID_CHOICE.search(message)
        if match is not None:
            choices: list[str] = []
            for action in self._actions:
                if action.choices is not None:
                    choices += [str(choice) for choice in action.choices]
            guess = closest(match.group(1), choices)
            if guess is not None:
                message = f"{message}; did you mean {guess!r}?"
        super().error(message)

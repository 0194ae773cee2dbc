"""``did you mean …`` for the command line: an argparse parser whose invalid-choice error
names the closest choice (a mistyped subcommand, ``--log-level`` value …).

Standard library only: ``prismctl`` uses it too.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Iterable
from typing import NoReturn

_INVALID_CHOICE = re.compile(r"invalid choice: '?([^'\s]+)'?")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)$")


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
        unknown = _UNRECOGNIZED.match(message)
        if unknown is not None:
            options = self._option_strings()
            guesses = [
                (word.partition("=")[0], guess)
                for word in unknown.group(1).split()
                if word.startswith("--")
                and (guess := closest(word.partition("=")[0], options)) is not None
            ]
            if len(guesses) == 1:
                message = f"{message}; did you mean {guesses[0][1]!r}?"
            elif guesses:
                said = ", ".join(f"{guess!r} for {word}" for word, guess in guesses)
                message = f"{message}; did you mean {said}?"
        if message.endswith("required: COMMAND"):
            # A bare `prismd` / `prismctl`: the commands are what the person is looking for.
            self.print_help(sys.stderr)
        super().error(message)

    def _option_strings(self) -> list[str]:
        """Every ``--option`` of this parser and its subcommands (argparse reports unknown
        options from the top parser, which does not know which subcommand meant them)."""
        found: list[str] = []
        for action in self._actions:
            found += [o for o in action.option_strings if o.startswith("--")]
            if isinstance(action, argparse._SubParsersAction):
                for parser in action.choices.values():
                    for inner in parser._actions:
                        found += [o for o in inner.option_strings if o.startswith("--")]
        return found

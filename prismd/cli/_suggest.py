"""``did you mean …`` for the command line: an argparse parser whose invalid-choice error
names the closest choice (a mistyped subcommand, ``--log-level`` value …).

Standard library only: ``prismctl`` uses it too.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Iterable, Sequence
from typing import NoReturn

_INVALID_CHOICE = re.compile(r"invalid choice: '?([^'\s]+)'?")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)$")
_REQUIRED = re.compile(r"the following arguments are required: (.*)$")


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
        missing = _REQUIRED.search(message)
        words: list[str] = []
        options: list[str] = []
        if unknown is not None:
            words, options = unknown.group(1).split(), self._option_strings()
        elif missing is not None:
            # A required option that was mistyped is reported missing, not unrecognized.
            known = set(self._option_strings())
            words = [w for w in self._seen if w.partition("=")[0] not in known]
            options = [o for o in missing.group(1).split(", ") if o.startswith("--")]
        if words:
            guesses = [
                (word.partition("=")[0], guess)
                for word in words
                if word.startswith("--")
                and (guess := closest(word.partition("=")[0], options)) is not None
            ]
            if guesses and missing is not None:
                said = ", ".join(f"{word} is no option: {guess!r}?" for word, guess in guesses)
                message = f"{message} ({said})"
            elif len(guesses) == 1:
                message = f"{message}; did you mean {guesses[0][1]!r}?"
            elif guesses:
                said = ", ".join(f"{guess!r} for {word}" for word, guess in guesses)
                message = f"{message}; did you mean {said}?"
        if message.endswith("required: COMMAND"):
            # A bare `prismd` / `prismctl`: the commands are what the person is looking for.
            self.print_help(sys.stderr)
        super().error(message)

    _seen: tuple[str, ...] = ()

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        # Kept for error(): the words this parser was given (a subcommand's own, for its
        # parser), to name a mistyped required option.
        self._seen = tuple(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

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

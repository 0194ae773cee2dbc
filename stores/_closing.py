"""``async with`` for a store that is open once made (memory, SQLite)."""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Self


class ClosesOnExit(abc.ABC):
    """``async with store:`` gives the store itself and closes it (``aclose``) when the
    block ends."""

    __slots__ = ()

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close the store (the backend's own)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

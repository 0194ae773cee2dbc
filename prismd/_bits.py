"""A boolean kept as one bit of an object's ``flags`` int: for the records kept by the ten
thousand (a parked turn, a followed remote task), eight booleans cost one small int
(shared, cached by CPython) instead of eight slots."""

from __future__ import annotations

from typing import Any, Protocol, overload


class HasFlags(Protocol):
    flags: int


class Bit:
    """``name = Bit(4)`` in a class with a ``flags: int`` slot: reads and writes that bit."""

    __slots__ = ("mask",)

    def __init__(self, mask: int) -> None:
        self.mask = mask

    @overload
    def __get__(self, obj: None, owner: Any = None) -> Bit: ...

    @overload
    def __get__(self, obj: HasFlags, owner: Any = None) -> bool: ...

    def __get__(self, obj: HasFlags | None, owner: Any = None) -> Bit | bool:
        if obj is None:
            return self
        return bool(obj.flags & self.mask)

    def __set__(self, obj: HasFlags, value: bool) -> None:
        obj.flags = obj.flags | self.mask if value else obj.flags & ~self.mask

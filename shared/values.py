"""Base classes for the slotted value classes of the services and the simulator.

The worker, router, planner and simulator value classes were ``@dataclass(slots=True)`` /
``@dataclass(frozen=True, slots=True)``. Creating a dataclass at import costs ~3M
instructions per class (``dataclasses`` compiles each generated method from source and,
for ``slots=True``, builds the class twice; cachegrind): 21 of them were ~77M instructions
of a 1-s simulation run (2.299 -> 2.222 G, commit 7609609), ~2% of a short run. So each
class is written out: ``__slots__``, ``__match_args__`` and a hand-written ``__init__``
(hot: built per request, chunk or plan). What a dataclass would generate besides, the
same for every class, lives here once:

* :class:`Value` - ``dataclass(slots=True)``: ``__repr__`` (``QualName(f1=..., f2=...)``,
  recursion-safe), ``__eq__`` (same class, field tuples equal), unhashable.
* :class:`FrozenValue` - ``dataclass(frozen=True, slots=True)``: adds ``__hash__`` of the
  field tuple, :class:`dataclasses.FrozenInstanceError` on assignment or deletion, and
  ``__getstate__``/``__setstate__`` (pickling and :mod:`copy`); its ``__init__`` sets
  fields with :data:`set_field` (``object.__setattr__``).
* :class:`IdentityValue` - ``dataclass(slots=True, eq=False)``: the ``__repr__`` only;
  equality and hash by identity.
* :class:`StructValue` - ``dataclass(slots=True)`` as a ``msgspec.Struct`` (fields declared by
  annotation, a per-instance default by ``msgspec.field(default_factory=...)``; no ``_compare_skip``):
  for the classes built per plan, state or request in the simulator's loop. Calling a Python class
  in CPython 3.11 goes through ``type.__call__`` and a Python ``__init__`` frame: ~1,600
  instructions for one field, ~3,000 for twelve; a Struct is built by C code (~1,300 for twelve;
  cachegrind, 200,000 constructions less an empty loop).

A subclass's fields are its ``__match_args__``, in order (a dataclass's ``__match_args__``
are its ``__init__`` fields; none of these classes has a keyword-only or ``init=False``
field), and its ``__slots__`` hold the same names. A field left out of the repr
(``field(repr=False)``) is named in ``_repr_skip``, one left out of ``==`` and the hash
(``field(compare=False)``) in ``_compare_skip``. tests/unit/shared/test_values.py checks
every subclass against the dataclass made from the same fields.

Base classes, not a class decorator: a decorator would have to create the methods per
class (the cost this avoids) or assign shared functions, which is what inheritance does
without a call at import. The bases add no cost to a field read or write: a field is a
slot descriptor found through the type's attribute cache, however deep the MRO, and none
of the bases defines ``__getattribute__``; a non-frozen class keeps ``object.__setattr__``.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from reprlib import recursive_repr
from typing import Any, ClassVar

import msgspec

__all__ = ["FACTORY", "FrozenStructValue", "FrozenValue", "IdentityValue", "StructValue", "Value", "set_field"]

FACTORY: Any = object()
"""Default of a field made per instance (``field(default_factory=list)``): the ``__init__``
makes a new list / dict / set when it gets this."""

set_field = object.__setattr__
"""``set_field(self, name, value)``: sets a field of a :class:`FrozenValue` in its ``__init__``
(what a frozen dataclass's ``__init__`` does)."""


def _compared(value: Value) -> tuple[Any, ...]:
    """The fields ``==`` and the hash compare, in order."""
    skip = value._compare_skip
    if skip:
        return tuple([getattr(value, name) for name in value.__match_args__ if name not in skip])
    return tuple([getattr(value, name) for name in value.__match_args__])


class Value:
    """What ``dataclass(slots=True)`` generates besides ``__init__``: ``__repr__``, ``__eq__``,
    and ``__hash__ = None`` (unhashable, as a mutable dataclass with ``eq=True``).

    A subclass declares ``__slots__`` and ``__match_args__`` (its field names, in order).
    """

    __slots__ = ()
    __match_args__: ClassVar[tuple[str, ...]] = ()
    _repr_skip: ClassVar[tuple[str, ...]] = ()
    """Fields left out of the repr (a dataclass's ``field(repr=False)``)."""
    _compare_skip: ClassVar[tuple[str, ...]] = ()
    """Fields left out of ``==`` and the hash (a dataclass's ``field(compare=False)``)."""

    @recursive_repr()
    def __repr__(self) -> str:
        skip = self._repr_skip
        fields = ", ".join([f"{name}={getattr(self, name)!r}" for name in self.__match_args__ if name not in skip])
        return f"{self.__class__.__qualname__}({fields})"

    def __eq__(self, other: object) -> bool:
        if other.__class__ is self.__class__:
            return _compared(self) == _compared(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class FrozenValue(Value):
    """What ``dataclass(frozen=True, slots=True)`` generates besides ``__init__``: as
    :class:`Value`, plus ``__hash__`` of the compared fields, ``FrozenInstanceError`` on
    assignment or deletion, and ``__getstate__``/``__setstate__`` (a frozen slotted class
    cannot be unpickled or copied through ``setattr``)."""

    __slots__ = ()

    def __hash__(self) -> int:  # type: ignore[override]  # Value's is None (unhashable): a frozen value hashes
        return hash(_compared(self))

    def __setattr__(self, name: str, value: Any) -> None:
        # the dataclass: any name on the class itself, field names on a plain subclass
        # (the class itself = the one that declares the fields)
        if name in self.__match_args__ or "__match_args__" in type(self).__dict__:
            raise FrozenInstanceError(f"cannot assign to field {name!r}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if name in self.__match_args__ or "__match_args__" in type(self).__dict__:
            raise FrozenInstanceError(f"cannot delete field {name!r}")
        object.__delattr__(self, name)

    def __getstate__(self) -> list[Any]:
        return [getattr(self, name) for name in self.__match_args__]

    def __setstate__(self, state: list[Any]) -> None:
        for name, value in zip(self.__match_args__, state):
            set_field(self, name, value)


class IdentityValue(Value):
    """What ``dataclass(slots=True, eq=False)`` generates besides ``__init__``: the
    :class:`Value` ``__repr__``; ``==`` and the hash are object identity (mutable records
    kept in dicts and sets, or compared by ``is``)."""

    __slots__ = ()
    __eq__ = object.__eq__
    __hash__ = object.__hash__  # type: ignore[assignment]


@recursive_repr()
def _struct_repr(self: Any) -> str:
    """:class:`Value`'s ``__repr__`` for a Struct: its fields in order, less ``_repr_skip``."""
    skip = self._repr_skip
    fields = ", ".join([f"{name}={getattr(self, name)!r}" for name in self.__struct_fields__ if name not in skip])
    return f"{self.__class__.__qualname__}({fields})"


class StructValue(msgspec.Struct):
    """What :class:`Value` gives, for a ``msgspec.Struct``: the same ``__repr__`` (``QualName(f1=...,
    f2=...)``, recursion-safe, without the fields named in ``_repr_skip``); ``==`` (same class, every
    field equal), unhashable, ``__match_args__``, pickling and :mod:`copy` are the Struct's own.

    A subclass declares its fields by annotation, in order (positional or keyword construction, no
    type checks at construction); a field made per instance (a :data:`FACTORY` default of a
    :class:`Value`) is ``msgspec.field(default_factory=list)``. Every field is compared (no
    ``_compare_skip``). tests/unit/shared/test_values.py checks every subclass against the dataclass
    made from the same fields.
    """

    _repr_skip: ClassVar[tuple[str, ...]] = ()
    """Fields left out of the repr (a dataclass's ``field(repr=False)``)."""

    __repr__ = _struct_repr


class FrozenStructValue(msgspec.Struct, frozen=True):
    """:class:`StructValue` for a :class:`FrozenValue`: hashable (the Struct's hash of its fields, not
    ``hash`` of their tuple: for no class kept in a set or ordered by hash), and assigning raises
    ``AttributeError`` (``FrozenInstanceError``'s base, not it). Checked as :class:`StructValue`'s are."""

    _repr_skip: ClassVar[tuple[str, ...]] = ()
    """Fields left out of the repr (a dataclass's ``field(repr=False)``)."""

    __repr__ = _struct_repr

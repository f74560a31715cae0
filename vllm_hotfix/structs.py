"""Plain data classes for the modules every build imports, without dataclasses' import-time cost.

``@dataclass`` writes and compiles the source of ``__init__``, ``__eq__``,
``__repr__``, ``__hash__`` and (frozen) ``__setattr__`` for every class
when its module is imported: for the fifteen classes a build imports, about
35 ms of every run, a fifth of an assembled build. ``@struct`` gives the
same behaviour from generic methods that read the class's field list, so
defining a class costs next to nothing; making an instance costs a little
more, which a build that makes a few hundred does not notice.

What it supports is what those classes use: fields from annotations, in
order, with defaults or ``field(default_factory=..., compare=..., repr=...)``;
frozen (the default) or not; equality and, when frozen, hashing over the
compared fields; ``replace``. Type checkers see it as a dataclass
(``dataclass_transform``). Modules a build does not import (pins, smoke,
push, upstream, ...) keep ``dataclasses``, whose extras (``asdict``) some use.
"""

from __future__ import annotations

from typing import Any, TypeVar, dataclass_transform

T = TypeVar("T")
_MISSING: Any = object()


class FrozenError(AttributeError):
    """An attempt to change a field of a frozen struct."""


class _Field:
    __slots__ = ("default", "factory", "compare", "repr")

    def __init__(self, default: Any, factory: Any, compare: bool, repr: bool) -> None:  # noqa: A002
        self.default, self.factory, self.compare, self.repr = default, factory, compare, repr


def field(*, default: Any = _MISSING, default_factory: Any = None, compare: bool = True,
          repr: bool = True) -> Any:  # noqa: A002
    """A field's default (or a factory making one per instance), and whether eq and repr show it."""
    return _Field(default, default_factory, compare, repr)


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    cls = type(self)
    names: tuple[str, ...] = cls.__struct_fields__
    if len(args) > len(names):
        raise TypeError(f"{cls.__name__}() takes {len(names)} positional arguments but {len(args)} were given")
    values = dict(zip(names, args, strict=False))
    for key, value in kwargs.items():
        if key not in cls.__struct_specs__:
            raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {key!r}")
        if key in values:
            raise TypeError(f"{cls.__name__}() got multiple values for argument {key!r}")
        values[key] = value
    for name in names:
        if name not in values:
            spec = cls.__struct_specs__[name]
            if spec.factory is not None:
                values[name] = spec.factory()
            elif spec.default is not _MISSING:
                values[name] = spec.default
            else:
                raise TypeError(f"{cls.__name__}() missing required argument {name!r}")
        object.__setattr__(self, name, values[name])


def _compared(self: Any) -> tuple[Any, ...]:
    return tuple(getattr(self, n) for n in type(self).__struct_compared__)


def _eq(self: Any, other: Any) -> Any:
    if type(other) is not type(self):
        return NotImplemented
    return _compared(self) == _compared(other)


def _hash(self: Any) -> int:
    return hash(_compared(self))


def _repr(self: Any) -> str:
    cls = type(self)
    shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in cls.__struct_fields__ if cls.__struct_specs__[n].repr)
    return f"{cls.__qualname__}({shown})"


def _frozen_setattr(self: Any, name: str, value: Any) -> None:
    raise FrozenError(f"cannot assign to field {name!r} of a frozen {type(self).__name__}")


def _frozen_delattr(self: Any, name: str) -> None:
    raise FrozenError(f"cannot delete field {name!r} of a frozen {type(self).__name__}")


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def struct(cls: type[T] | None = None, *, frozen: bool = True) -> Any:
    """Make ``cls`` a data class: ``@struct`` (frozen) or ``@struct(frozen=False)``."""

    def make(cls: type[T]) -> type[T]:
        specs: dict[str, _Field] = {}
        for name in cls.__dict__.get("__annotations__", {}):
            given = cls.__dict__.get(name, _MISSING)
            spec = given if isinstance(given, _Field) else _Field(given, None, True, True)
            if spec.default is _MISSING and spec.factory is None and any(
                    s.default is not _MISSING or s.factory is not None for s in specs.values()):
                raise TypeError(f"{cls.__name__}: field {name!r} without a default follows one with a default")
            specs[name] = spec
            if isinstance(given, _Field):  # as dataclasses do: the class keeps a plain default only
                if spec.default is _MISSING:
                    delattr(cls, name)
                else:
                    setattr(cls, name, spec.default)
        setattrs: dict[str, Any] = {
            "__struct_fields__": tuple(specs),
            "__struct_specs__": specs,
            "__struct_compared__": tuple(n for n, s in specs.items() if s.compare),
            "__init__": _init,
            "__eq__": _eq,
            "__repr__": _repr,
            # Like dataclasses: hashable when frozen, unhashable when mutable and compared by value.
            "__hash__": _hash if frozen else None,
        }
        if frozen:
            setattrs.update(__setattr__=_frozen_setattr, __delattr__=_frozen_delattr)
        for key, value in setattrs.items():
            setattr(cls, key, value)
        return cls

    return make(cls) if cls is not None else make


def replace(obj: T, **changes: Any) -> T:
    """A copy of struct ``obj`` with ``changes`` (``dataclasses.replace``)."""
    values = {n: getattr(obj, n) for n in type(obj).__struct_fields__}  # type: ignore[attr-defined]
    values.update(changes)
    return type(obj)(**values)

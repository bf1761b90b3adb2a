"""Registries by name: the one lookup used by compressors, collectives and
error-feedback schemes."""

from __future__ import annotations

from typing import Generic, TypeVar, cast

T = TypeVar("T")
# A registered class, its own type kept (a decorator returning type[T]
# would hide its fields from type checkers).
C = TypeVar("C", bound=type)


class Registry(Generic[T]):
  """Classes registered under their ``name`` class attribute.

  Args:
    param: the parameter of :func:`jaxcomp.compressed_mean` that names an
      entry (``"compressor"``, ``"collective"``, ``"error_feedback"``); error
      messages say it.
  """

  def __init__(self, param: str):
    self.param = param
    self._classes: dict[str, type[T]] = {}

  def register(self, cls: C) -> C:
    """Class decorator: registers ``cls`` under ``cls.name``.

    Raises:
      ValueError: ``cls.name`` is empty or already registered.
    """
    name = getattr(cls, "name", "")
    if not name:
      raise ValueError(f"{cls.__name__} has no name to register as a "
                       f"{self.param}")
    if name in self._classes:
      raise ValueError(f"{self.param} name {name!r} is already registered")
    self._classes[name] = cast("type[T]", cls)
    return cls

  def names(self) -> list[str]:
    """The registered names, sorted."""
    return sorted(self._classes)

  def __contains__(self, name) -> bool:
    return isinstance(name, str) and name in self._classes

  def lookup(self, name: str) -> type[T]:
    """The class registered as ``name``.

    Raises:
      ValueError: ``name`` is not registered; the message lists the names.
    """
    if name not in self:
      raise ValueError(
          f"unknown {self.param} {name!r}; choose one of {self.names()}")
    return self._classes[name]

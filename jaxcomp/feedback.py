"""Error feedback: what happens to what the compressor did not send.

A feedback scheme wraps one compressed exchange of a flat float32 buffer. Its
``apply(x, state, exchange)`` gets the device's gradient ``x`` (float32
``(n,)``), its own state for that buffer, and ``exchange(v) -> (mean, local)``
(see :mod:`jaxcomp.collectives`), and returns the averaged update and the new
state. The per-device parts of the state are created *varying* over the axis,
so ``jax.shard_map`` keeps one copy per device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

Exchange = Callable[[jax.Array], tuple[jax.Array, jax.Array]]


class Feedback:
  """Base class of the error-feedback schemes."""

  name: ClassVar[str] = ""

  def init(self, n: int, axis_name) -> Any:
    """State for one buffer of ``n`` elements (inside shard_map/pmap)."""
    raise NotImplementedError

  def apply(self, x: jax.Array, state: Any,
            exchange: Exchange) -> tuple[jax.Array, Any]:
    raise NotImplementedError

  def residual(self, state: Any) -> jax.Array | None:
    """The per-device residual in ``state`` (for statistics), if any."""
    return None


@dataclasses.dataclass(frozen=True)
class NoFeedback(Feedback):
  """Sends the compressed gradient; what is not sent is lost."""

  name: ClassVar[str] = "none"

  def init(self, n, axis_name):
    del n, axis_name
    return ()

  def apply(self, x, state, exchange):
    mean, _ = exchange(x)
    return mean, state


def varying_zeros(n: int, axis_name) -> jax.Array:
  """float32 zeros ``(n,)`` typed as varying over ``axis_name``."""
  return lax.pcast(jnp.zeros((n,), jnp.float32), axis_name, to="varying")


@dataclasses.dataclass(frozen=True)
class ResidualFeedback(Feedback):
  """Residual error feedback (EF-SGD).

  Each device keeps ``e`` (float32, shape ``(n,)``), compresses ``v = x + e``
  and keeps ``e' = v - local`` where ``local`` is what it actually
  contributed. Mass is conserved: ``local + e' == x + e`` per device (up to
  one float32 rounding of the subtraction).

  References:
    Stich, Cordonnier & Jaggi, Sparsified SGD with Memory
    <https://arxiv.org/abs/1809.07599>, 2018; Karimireddy et al., Error
    Feedback Fixes SignSGD and other Gradient Compression Schemes
    <https://arxiv.org/abs/1901.09847>, 2019.
  """

  name: ClassVar[str] = "residual"

  def init(self, n, axis_name):
    return varying_zeros(n, axis_name)

  def apply(self, x, state, exchange):
    v = x + state
    mean, local = exchange(v)
    return mean, v - local

  def residual(self, state):
    return state


_REGISTRY = {NoFeedback.name: NoFeedback, ResidualFeedback.name: ResidualFeedback}


def register(cls):
  """Class decorator: registers a Feedback subclass under ``cls.name``."""
  if cls.name in _REGISTRY:
    raise ValueError(f"feedback name {cls.name!r} is already registered")
  _REGISTRY[cls.name] = cls
  return cls


def names() -> list[str]:
  return sorted(_REGISTRY)


def get(feedback: str | bool | Feedback | None, biased: bool) -> Feedback:
  """Resolves a feedback scheme.

  Args:
    feedback: a name (see :func:`names`), a Feedback, ``True`` (residual),
      ``False`` (none), or ``None`` (residual for biased compressors, none
      for unbiased ones).
    biased: whether the compressor is biased.

  Raises:
    ValueError: unknown name.
  """
  if feedback is None:
    feedback = biased
  if feedback is True:
    return ResidualFeedback()
  if feedback is False:
    return NoFeedback()
  if isinstance(feedback, Feedback):
    return feedback
  if isinstance(feedback, str) and feedback in _REGISTRY:
    return _REGISTRY[feedback]()
  raise ValueError(
      f"unknown error_feedback {feedback!r}; choose one of {names()}, True, "
      "False or None")

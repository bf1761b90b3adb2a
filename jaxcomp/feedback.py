"""Error feedback: what happens to what the compressor did not send.

A feedback scheme wraps one compressed exchange of a gradient bucket. A bucket
is held as its *parts*: a tuple with one flat float32 ``(size_i,)`` array per
tensor in it, in bucket order (:data:`Parts`). The scheme's
``apply(x, state, exchange)`` gets the device's gradient parts ``x``, its own
state for that bucket, and ``exchange(v) -> (mean, local)`` (parts in, parts
out; the transform concatenates them for the collective, see
:mod:`jaxcomp.collectives`), and returns the averaged update (parts) and the
new state.

The state keeps one array per tensor, not one per bucket: a per-tensor
residual is updated with per-tensor arithmetic, where a flat bucket residual
would need the bucket's concatenation fused into every update (on XLA:CPU
such multi-operand concatenate fusions run several times slower than the
arithmetic itself), and where the compressor works per tensor (PowerSGD)
no concatenation is left at all. The per-device parts of the state are
created *varying* over the axis, so ``jax.shard_map`` keeps one copy per
device.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, ClassVar, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax

Parts = tuple  # tuple[jax.Array, ...]: one float32 (size_i,) array per tensor
Exchange = Callable[[Parts], tuple[Parts, Parts]]


class Feedback:
  """Base class of the error-feedback schemes."""

  name: ClassVar[str] = ""

  def init(self, sizes: Sequence[int], axis_name) -> Any:
    """State for one bucket whose tensors have ``sizes`` elements (inside
    shard_map/pmap)."""
    raise NotImplementedError

  def apply(self, x: Parts, state: Any,
            exchange: Exchange) -> tuple[Parts, Any]:
    raise NotImplementedError

  def residual(self, state: Any) -> Parts | None:
    """The per-device residual parts in ``state`` (for statistics), if any."""
    return None


def _add(a: Parts, b: Parts) -> Parts:
  return tuple(x + y for x, y in zip(a, b))


def _sub(a: Parts, b: Parts) -> Parts:
  return tuple(x - y for x, y in zip(a, b))


@dataclasses.dataclass(frozen=True)
class NoFeedback(Feedback):
  """Sends the compressed gradient; what is not sent is lost."""

  name: ClassVar[str] = "none"

  def init(self, sizes, axis_name):
    del sizes, axis_name
    return ()

  def apply(self, x, state, exchange):
    mean, _ = exchange(x)
    return mean, state


def varying_zeros(n: int, axis_name) -> jax.Array:
  """float32 zeros ``(n,)`` typed as varying over ``axis_name``."""
  return lax.pcast(jnp.zeros((n,), jnp.float32), axis_name, to="varying")


def varying_zero_parts(sizes: Sequence[int], axis_name) -> Parts:
  """One :func:`varying_zeros` per size."""
  return tuple(varying_zeros(n, axis_name) for n in sizes)


def concat_parts(parts: Parts) -> jax.Array:
  """The parts as one flat array (the bucket's layout), e.g. to inspect a
  bucket's residual; works on the state's global arrays too (leading device
  axis), concatenating along the last axis."""
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


def split_parts(flat: jax.Array, sizes: Sequence[int]) -> Parts:
  """The inverse of :func:`concat_parts`: ``flat`` (``(sum(sizes),)``) cut
  into consecutive pieces of ``sizes`` elements."""
  if len(sizes) == 1:
    return (flat,)
  return tuple(jnp.split(flat, list(itertools.accumulate(sizes))[:-1]))


@dataclasses.dataclass(frozen=True)
class ResidualFeedback(Feedback):
  """Residual error feedback (EF-SGD).

  Each device keeps ``e`` (float32 parts, one ``(size_i,)`` array per
  tensor), compresses ``v = x + e`` and keeps ``e' = v - local`` where
  ``local`` is what it actually contributed. Mass is conserved: ``local + e' == x + e`` per device (up to
  one float32 rounding of the subtraction).

  References:
    Stich, Cordonnier & Jaggi, Sparsified SGD with Memory
    <https://arxiv.org/abs/1809.07599>, 2018; Karimireddy et al., Error
    Feedback Fixes SignSGD and other Gradient Compression Schemes
    <https://arxiv.org/abs/1901.09847>, 2019.
  """

  name: ClassVar[str] = "residual"

  def init(self, sizes, axis_name):
    return varying_zero_parts(sizes, axis_name)

  def apply(self, x, state, exchange):
    v = _add(x, state)
    mean, local = exchange(v)
    return mean, _sub(v, local)

  def residual(self, state):
    return state


class EF21State(NamedTuple):
  """State of :class:`EF21` for one buffer."""

  local: Parts  # per tensor (size_i,), float32, g_i: this device's estimate (varying)
  shared: Parts  # per tensor (size_i,), float32, g = mean_i g_i (invariant)


@dataclasses.dataclass(frozen=True)
class EF21(Feedback):
  """EF21 error feedback (Richtarik et al. 2021).

  Each device keeps an estimate ``g_i`` of its gradient and every device the
  same ``g = mean_i g_i``. Per step, device ``i`` compresses the *difference*
  ``c_i = C(x_i - g_i)``, then ``g_i' = g_i + c_i`` and ``g' = g + mean_i c_i``;
  the update is ``g'``. Unlike residual feedback (EF-SGD), nothing
  accumulates: for a contractive compressor ``g_i`` tracks ``x_i``, and
  ``g' = mean_i g_i'`` holds exactly in exact arithmetic (up to float32
  rounding of the two running sums).

  State: :class:`EF21State` (``local`` varying over the axis, ``shared``
  invariant), float32 parts (one ``(size_i,)`` array per tensor) each.

  References:
    Richtarik, Sokolov & Fatkhullin, EF21: A New, Simpler, Theoretically
    Better, and Practically Faster Error Feedback
    <https://arxiv.org/abs/2106.05203>, 2021.
  """

  name: ClassVar[str] = "ef21"

  def init(self, sizes, axis_name):
    return EF21State(local=varying_zero_parts(sizes, axis_name),
                     shared=tuple(jnp.zeros((n,), jnp.float32) for n in sizes))

  def apply(self, x, state, exchange):
    mean, local = exchange(_sub(x, state.local))
    shared = _add(state.shared, mean)
    return shared, EF21State(local=_add(state.local, local), shared=shared)


class DGCState(NamedTuple):
  """State of :class:`DGCFeedback` for one buffer (both varying)."""

  momentum: Parts  # per tensor (size_i,), float32, u: corrected momentum
  accumulation: Parts  # per tensor (size_i,), float32, v: accumulated, unsent


@dataclasses.dataclass(frozen=True)
class DGCFeedback(Feedback):
  """DGC momentum correction, momentum factor masking and local clipping.

  Per device and step, with gradient ``g``:

  1. local gradient clipping (if ``clip_norm``): ``g *= min(1, clip_norm /
     ||g||_2)`` over the bucket. DGC clips each node at the global threshold
     times ``N ** -0.5``: pass that product as ``clip_norm``;
  2. momentum correction: ``u = momentum * u + g``; ``v = v + u``;
  3. send ``v`` through the compressor (e.g. ``"dgc"`` or ``"topk"``); with
     ``local`` what was sent, ``v = v - local`` (zero where sent);
  4. momentum factor masking: ``u = 0`` where an entry was sent
     (``local != 0``).

  The update is the mean of what was sent; since the momentum lives here,
  chain plain SGD (``optax.sgd(lr)``, no momentum) after the transform.

  Args:
    momentum: momentum coefficient in [0, 1).
    clip_norm: local L2 clipping threshold (> 0), or None.

  Raises:
    ValueError: ``momentum`` outside [0, 1) or ``clip_norm`` <= 0.

  References:
    Lin et al., Deep Gradient Compression: Reducing the Communication
    Bandwidth for Distributed Training <https://arxiv.org/abs/1712.01887>,
    2018.
  """

  name: ClassVar[str] = "dgc"
  momentum: float = 0.9
  clip_norm: float | None = None

  def __post_init__(self):
    if not 0.0 <= self.momentum < 1.0:
      raise ValueError(f"momentum must be in [0, 1), got {self.momentum=}")
    if self.clip_norm is not None and not self.clip_norm > 0:
      raise ValueError(f"clip_norm must be > 0 or None, got {self.clip_norm=}")

  def init(self, sizes, axis_name):
    return DGCState(momentum=varying_zero_parts(sizes, axis_name),
                    accumulation=varying_zero_parts(sizes, axis_name))

  def apply(self, x, state, exchange):
    if self.clip_norm is not None:
      norm = jnp.sqrt(sum(jnp.sum(p * p) for p in x))
      scale = jnp.minimum(1.0, jnp.float32(self.clip_norm) / jnp.maximum(
          norm, jnp.finfo(jnp.float32).tiny))
      x = tuple(p * scale for p in x)
    u = _add(tuple(jnp.float32(self.momentum) * m for m in state.momentum), x)
    v = _add(state.accumulation, u)
    mean, local = exchange(v)
    return mean, DGCState(
        momentum=tuple(jnp.where(l != 0, 0.0, ui) for l, ui in zip(local, u)),
        accumulation=_sub(v, local))

  def residual(self, state):
    return state.accumulation


_REGISTRY = {NoFeedback.name: NoFeedback, ResidualFeedback.name: ResidualFeedback,
             EF21.name: EF21, DGCFeedback.name: DGCFeedback}


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

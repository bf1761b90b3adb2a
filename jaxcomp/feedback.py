"""Error feedback: what happens to what the compressor did not send.

A feedback scheme is two pure steps that :func:`jaxcomp.compressed_mean`
runs around each bucket's collective exchange::

  v, ctx = feedback.prepare(x, state)          # what to send
  mean, local, _ = collective.exchange(..., v, ...)
  out, state = feedback.finish(ctx, mean, local)  # the update and new state

A bucket is held as its *parts* (:mod:`jaxcomp._parts`): one flat float32
``(size_i,)`` array per tensor in it, in bucket order. ``x`` is this
device's gradient, ``mean`` the average of what every device sent (the same
on every device), ``local`` what this device contributed to it.

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
import numbers
from typing import Any, ClassVar, NamedTuple
from collections.abc import Sequence

import jax.numpy as jnp

from jaxcomp._mesh import varying_zeros
from jaxcomp._parts import Parts, add, sub
from jaxcomp._registry import Registry


class Feedback:
  """Base class of the error-feedback schemes."""

  name: ClassVar[str] = ""

  def init(self, sizes: Sequence[int], axis_name) -> Any:
    """State for one bucket whose tensors have ``sizes`` elements (inside
    shard_map/pmap)."""
    raise NotImplementedError

  # Whether the state holds the whole mean (EF21's shared estimate): such
  # feedback cannot run where each device gets only its shard of the mean.
  keeps_mean: ClassVar[bool] = False

  def prepare(self, x: Parts, state: Any) -> tuple[Parts, Any]:
    """``(v, ctx)``: the parts to exchange for gradient ``x``, and what
    :meth:`finish` needs of this step."""
    raise NotImplementedError

  def finish(self, ctx: Any, mean: Parts, local: Parts) -> tuple[Parts, Any]:
    """``(out, state)``: the averaged update and the new state, from the
    exchange's ``mean`` and this device's contribution ``local``."""
    raise NotImplementedError

  # How the per-device state moves to a mesh of another size (see
  # jaxcomp.checkpoint.topology_rules): every scheme here keeps per-device
  # corrections in units of the gradient, so the mean over the saved
  # devices keeps what the mean update will still receive.
  topology: ClassVar[str] = "average"

  def unsent(self, state: Any) -> Parts | None:
    """What this device holds back in ``state``: the residual parts whose
    mass is still to be sent, if any (the transform's ``residual_norm``
    counts them with the collective's,
    :meth:`jaxcomp.collectives.Collective.unsent`)."""
    del state
    return None


REGISTRY: Registry[Feedback] = Registry("error_feedback")
register = REGISTRY.register
names = REGISTRY.names


@register
@dataclasses.dataclass(frozen=True)
class NoFeedback(Feedback):
  """Sends the compressed gradient; what is not sent is lost."""

  name: ClassVar[str] = "none"

  def init(self, sizes, axis_name):
    del sizes, axis_name
    return ()

  def prepare(self, x, state):
    return x, state

  def finish(self, ctx, mean, local):
    del local
    return mean, ctx


def varying_zero_parts(sizes: Sequence[int], axis_name) -> Parts:
  """One float32 ``(size_i,)`` zero array per size, varying over
  ``axis_name``: a per-device state in parts."""
  return tuple(varying_zeros((n,), axis_name) for n in sizes)


@register
@dataclasses.dataclass(frozen=True)
class ResidualFeedback(Feedback):
  """Residual error feedback (EF-SGD).

  Each device keeps ``e`` (float32 parts, one ``(size_i,)`` array per
  tensor), compresses ``v = x + e`` and keeps ``e' = v - local`` where
  ``local`` is what it actually contributed. Mass is conserved: ``local + e' == x + e`` per device (up to
  one float32 rounding of the subtraction).

  With ``decay`` (``beta``), what was not sent fades: ``v = beta e + x``,
  the error-feedback accumulator of SparseLoCo (0.95 in Covenant /
  Templar's runs) and DeMo's decoupled momentum (0.999), which then sends
  ``v``'s fast components. ``None`` (the default) is plain EF-SGD
  (``beta = 1`` without the multiply).

  Args:
    decay: ``beta`` in ``[0, 1]``, or None.

  Raises:
    ValueError: ``decay`` outside ``[0, 1]``.

  References:
    Stich, Cordonnier & Jaggi, Sparsified SGD with Memory
    <https://arxiv.org/abs/1809.07599>, 2018; Karimireddy et al., Error
    Feedback Fixes SignSGD and other Gradient Compression Schemes
    <https://arxiv.org/abs/1901.09847>, 2019; Sarfi et al., Communication
    Efficient LLM Pre-training with SparseLoCo
    <https://arxiv.org/abs/2508.15706>, 2025 (decay); Peng, Quesnelle &
    Kingma, DeMo <https://arxiv.org/abs/2411.19870>, 2024 (decay).
  """

  name: ClassVar[str] = "residual"
  decay: float | None = None

  def __post_init__(self):
    if self.decay is not None and (
        isinstance(self.decay, bool) or not isinstance(self.decay, numbers.Real)
        or not 0.0 <= self.decay <= 1.0):
      raise ValueError(f"decay must be a number in [0, 1] or None, got "
                       f"decay={self.decay!r}")

  def init(self, sizes, axis_name):
    return varying_zero_parts(sizes, axis_name)

  def prepare(self, x, state):
    if self.decay is None:
      v = add(x, state)
    else:
      v = tuple(jnp.float32(self.decay) * e + g for e, g in zip(state, x))
    return v, v

  def finish(self, ctx, mean, local):
    return mean, sub(ctx, local)

  def unsent(self, state):
    return state


class EF21State(NamedTuple):
  """State of :class:`EF21` for one buffer."""

  local: Parts  # per tensor (size_i,), float32, g_i: this device's estimate (varying)
  shared: Parts  # per tensor (size_i,), float32, g = mean_i g_i (invariant)


@register
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
  keeps_mean: ClassVar[bool] = True

  def init(self, sizes, axis_name):
    return EF21State(local=varying_zero_parts(sizes, axis_name),
                     shared=tuple(jnp.zeros((n,), jnp.float32) for n in sizes))

  def prepare(self, x, state):
    return sub(x, state.local), state

  def finish(self, ctx, mean, local):
    shared = add(ctx.shared, mean)
    return shared, EF21State(local=add(ctx.local, local), shared=shared)


class DGCState(NamedTuple):
  """State of :class:`DGCFeedback` for one buffer (both varying)."""

  momentum: Parts  # per tensor (size_i,), float32, u: corrected momentum
  accumulation: Parts  # per tensor (size_i,), float32, v: accumulated, unsent


@register
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

  def prepare(self, x, state):
    if self.clip_norm is not None:
      norm = jnp.sqrt(sum(jnp.sum(p * p) for p in x))
      scale = jnp.minimum(1.0, jnp.float32(self.clip_norm) / jnp.maximum(
          norm, jnp.finfo(jnp.float32).tiny))
      x = tuple(p * scale for p in x)
    u = add(tuple(jnp.float32(self.momentum) * m for m in state.momentum), x)
    v = add(state.accumulation, u)
    return v, DGCState(momentum=u, accumulation=v)

  def finish(self, ctx, mean, local):
    return mean, DGCState(
        momentum=tuple(jnp.where(l != 0, 0.0, u)
                       for l, u in zip(local, ctx.momentum)),
        accumulation=sub(ctx.accumulation, local))

  def unsent(self, state):
    return state.accumulation


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
  if feedback in REGISTRY:
    return REGISTRY.lookup(feedback)()
  raise ValueError(
      f"unknown error_feedback {feedback!r}; choose one of {names()}, True, "
      "False or None")

"""What a NaN or Inf in some device's gradient does to a step
(``compressed_mean(nonfinite=...)``): three small policies."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from jaxcomp import _mesh


@dataclasses.dataclass(frozen=True)
class Policy:
  """Base: how the gradient is screened, and what a bad step keeps."""

  name: ClassVar[str] = ""
  # Whether a bad step leaves the error-feedback and collective state as it
  # was (the new state is discarded).
  keeps_state: ClassVar[bool] = True

  def screen(self, flat, axis_name):
    """``(flat, any_bad)``: the gradient buffers as they are sent, and
    whether any device's gradient had a NaN or Inf (a bool scalar,
    identical on every device)."""
    raise NotImplementedError

  def bucket_mean(self, any_bad, mean):
    """A bucket's averaged parts on a bad step."""
    del any_bad
    return mean

  def leaf(self, any_bad, m):
    """A leaf's update on a bad step."""
    del any_bad
    return m


@dataclasses.dataclass(frozen=True)
class Skip(Policy):
  """The update is zero on every device and no state moves."""

  name: ClassVar[str] = "skip"

  def screen(self, flat, axis_name):
    any_bad = _mesh.any_nonfinite(flat, axis_name)
    # Compress zeros instead, so no NaN travels or reaches any state.
    return [jnp.where(any_bad, jnp.zeros_like(x), x) for x in flat], any_bad

  def bucket_mean(self, any_bad, mean):
    return tuple(jnp.where(any_bad, 0.0, m) for m in mean)


@dataclasses.dataclass(frozen=True)
class Zero(Policy):
  """Non-finite entries are replaced by 0 before compressing."""

  name: ClassVar[str] = "zero"
  keeps_state: ClassVar[bool] = False

  def screen(self, flat, axis_name):
    del axis_name
    return ([jnp.where(jnp.isfinite(x), x, 0.0) for x in flat],
            jnp.zeros((), jnp.bool_))


@dataclasses.dataclass(frozen=True)
class Propagate(Policy):
  """The update is NaN on every device (for ``optax.apply_if_finite``) and
  no state moves."""

  name: ClassVar[str] = "propagate"

  def screen(self, flat, axis_name):
    any_bad = _mesh.any_nonfinite(flat, axis_name)
    return [jnp.where(jnp.isfinite(x), x, 0.0) for x in flat], any_bad

  def leaf(self, any_bad, m):
    return jnp.where(any_bad, jnp.nan, m)


@dataclasses.dataclass(frozen=True)
class Unchecked(Policy):
  """No check: the exchange carries a NaN or Inf as a plain all-reduce
  does. Only for transforms that keep no per-device state and send every
  coordinate summed in flight (identity, casts), where a non-finite value
  in any device's gradient reaches every device's mean by itself."""

  name: ClassVar[str] = "none"
  keeps_state: ClassVar[bool] = False

  def screen(self, flat, axis_name):
    del axis_name
    return flat, jnp.zeros((), jnp.bool_)


POLICIES = {p.name: p for p in (Skip, Zero, Propagate, Unchecked)}
NONFINITE_POLICIES = tuple(POLICIES)


def get(name: str) -> Policy:
  """The policy called ``name``.

  Raises:
    ValueError: an unknown name.
  """
  if name not in POLICIES:
    raise ValueError(
        f"nonfinite must be one of {NONFINITE_POLICIES}, got nonfinite={name!r}")
  return POLICIES[name]()

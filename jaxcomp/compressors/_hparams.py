"""Hyperparameters that may be traced (``optax.inject_hyperparams``).

``optax.inject_hyperparams(factory)`` calls ``factory`` inside ``init`` and
``update`` with every numeric argument turned into a ``jax.Array`` (traced
inside ``jit`` / ``shard_map``). A compressor built there must therefore
accept arrays for its hyperparameters: validation runs only where a value is
concrete, and a hyperparameter that fixes a payload *shape* (``ratio`` -> k,
``rank``, wire ``bits``) is split into a static capacity (``max_ratio``,
``max_rank``, ``max_bits``: a Python number) and the dynamic value, which
masks inside that capacity. The payload then always has the capacity's size.

Recipe (the scheduled hyperparameters are explicit arguments of a small
factory; ``compressed_mean``'s own ``**compressor_kwargs`` cannot be seen by
``inject_hyperparams``, and ``seed`` / ``min_compress_size`` must stay Python
numbers)::

  def make(ratio):
    return jaxcomp.compressed_mean("random_k", "data", ratio=ratio,
                                   max_ratio=0.1)
  tx = optax.inject_hyperparams(make)(
      ratio=optax.linear_schedule(0.1, 0.01, 100))
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.core
import jax.numpy as jnp
import numpy as np


def is_traced(v) -> bool:
  """True for a value only known at run time (a tracer)."""
  return isinstance(v, jax.core.Tracer)


def concrete(v, name: str = "hyperparameter"):
  """The Python number of a concrete scalar (number or array); None if
  traced.

  Raises:
    ValueError: an array that is not a scalar; the message names ``name``.
  """
  if is_traced(v):
    return None
  if isinstance(v, (jax.Array, np.ndarray)):
    if np.ndim(v) != 0:
      raise ValueError(f"{name} must be a scalar, got an array of shape "
                       f"{np.shape(v)}: {name}={v!r}")
    v = np.asarray(v).item()
  return v


def check_number(v, name: str, *, low=None, high=None, low_open=False,
                 integer=False) -> None:
  """Validates a scalar hyperparameter where it is concrete.

  Raises:
    TypeError: not a number (or not an integer where ``integer``).
    ValueError: NaN or infinite, or outside ``[low, high]`` (``(low, high]``
      with ``low_open``).
  """
  c = concrete(v, name)
  if c is None:
    return
  if isinstance(c, bool) or not isinstance(c, numbers.Real):
    raise TypeError(f"{name} must be a number, got {name}={v!r}")
  if not math.isfinite(c):
    raise ValueError(f"{name} must be a finite number, got {name}={c}")
  # numbers.Real declares no __int__ in typeshed; every Real here has one.
  if integer and float(c) != int(c):  # pyright: ignore[reportArgumentType]
    raise TypeError(f"{name} must be an integer, got {name}={c!r}")
  bad = (low is not None and (c <= low if low_open else c < low)) or (
      high is not None and c > high)
  if bad:
    lo = "(" if low_open else "["
    raise ValueError(f"{name} must be in {lo}{low}, {high}], got {name}={c}")


def check_positive_int(v, name: str) -> None:
  """A static integer hyperparameter >= 1 (a chunk size, a count).

  Raises:
    ValueError: not an integer (a bool is not), or below 1.
  """
  if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
    raise ValueError(f"{name} must be an integer >= 1, got {name}={v!r}")


def capacity(value, cap, name: str, cap_name: str):
  """The static capacity for a possibly traced ``value``.

  Returns ``cap`` when given (checking ``value <= cap`` where concrete), else
  ``value`` itself, which must then be concrete.

  Raises:
    ValueError: ``value`` is traced and ``cap`` is None, or ``value > cap``.
  """
  c = concrete(value, name)
  if cap is None:
    if c is None:
      raise ValueError(
          f"{name} is traced (e.g. scheduled by optax.inject_hyperparams), so "
          f"the payload size cannot follow it; set {cap_name}= to a Python "
          f"number, the largest {name} the schedule reaches")
    return c
  if c is not None and c > cap:
    raise ValueError(f"{name}={c} exceeds {cap_name}={cap}; raise {cap_name}")
  return cap


def check_ratio_capacity(ratio, max_ratio) -> None:
  """Validates a (possibly scheduled) ``ratio`` and its static ``max_ratio``:
  both in (0, 1] where concrete, and ``ratio <= max_ratio``.

  Raises:
    ValueError: as :func:`check_number` and :func:`capacity`.
  """
  check_number(ratio, "ratio", low=0.0, high=1.0, low_open=True)
  if max_ratio is not None:
    check_number(max_ratio, "max_ratio", low=0.0, high=1.0, low_open=True)
  capacity(ratio, max_ratio, "ratio", "max_ratio")


def ceil_count(ratio, n: int, cap: int) -> jax.Array:
  """int32 ``clip(ceil(ratio * n), 1, cap)`` for a possibly traced ratio."""
  c = concrete(ratio)
  if c is not None:
    return jnp.asarray(max(1, min(cap, math.ceil(round(float(c) * n, 6)))),
                       jnp.int32)
  k = jnp.ceil(jnp.asarray(ratio, jnp.float32) * jnp.float32(n))
  return jnp.clip(k, 1, cap).astype(jnp.int32)


def as_f32(v) -> jax.Array:
  """A hyperparameter as a float32 scalar array."""
  return jnp.asarray(v, jnp.float32)

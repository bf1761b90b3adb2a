"""The compressor interface and the registry of compressors by name.

A compressor is a pure encode/decode pair over a flat float32 buffer with
static payload shapes (XLA needs them). It knows nothing of collectives: the
collective (``jaxcomp.collectives``) decides how the payloads travel, reading
only the attributes declared here.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, ClassVar, Literal

import jax
import jax.numpy as jnp

from jaxcomp.compressors import _hparams

Payload = Any  # a pytree of arrays with static shapes
Randomness = Literal["none", "shared", "independent"]


class Compressor:
  """Base class of all compressors.

  Subclasses are frozen dataclasses whose fields are the hyperparameters.

  Class attributes:
    name: the registry name (``compressors.get(name, ...)``).
    linear: True when ``decode(a) + decode(b) == decode(a + b)`` elementwise on
      payloads (given the same shared randomness), so that ``lax.psum`` can sum
      payloads in flight; False when payloads must be all-gathered and decoded
      one by one.
    biased: True when ``E[decode(encode(x))] != x``; error feedback is then on
      by default in :func:`jaxcomp.compressed_mean`.
    randomness: ``"none"``; ``"shared"`` (the key passed to ``encode`` is the
      same on every device, e.g. random-block); or ``"independent"`` (the key
      differs per device, e.g. QSGD's stochastic rounding).
    own_exchange: True for compressors whose exchange is not a single
      encode / transfer / decode (PowerSGD, TernGrad's shared scale). They
      implement ``init_state`` and ``exchange`` and are run by
      ``jaxcomp.collectives.OwnExchange``; ``encode``/``decode`` may then be
      unused.
  """

  name: ClassVar[str] = ""
  linear: ClassVar[bool] = False
  biased: ClassVar[bool] = False
  randomness: ClassVar[Randomness] = "none"
  own_exchange: ClassVar[bool] = False

  def encode(self, x: jax.Array, key: jax.Array) -> Payload:
    """Encodes ``x`` (float32, shape ``(n,)``) into a payload pytree."""
    raise NotImplementedError

  def decode(self, payload: Payload, n: int, key: jax.Array) -> jax.Array:
    """Decodes one payload back to float32 of shape ``(n,)``.

    ``key`` is the key ``encode`` was given (shared compressors need it to
    place values; others ignore it).
    """
    raise NotImplementedError

  def init_state(self, n: int, axis_name) -> Any:
    """Per-bucket state of an ``own_exchange`` compressor (e.g. PowerSGD's Q).

    Called inside shard_map/pmap; per-device leaves must be created varying
    over ``axis_name`` (``lax.pcast``), shared ones invariant.
    """
    del n, axis_name
    return ()

  def exchange(self, x: jax.Array, key: jax.Array, axis_name,
               state: Any) -> tuple[jax.Array, jax.Array, Any]:
    """``own_exchange`` compressors: returns ``(mean, local, state)`` as
    :class:`jaxcomp.collectives.Collective.exchange` does."""
    raise NotImplementedError(f"{self.name} has no exchange of its own")

  def for_bucket(self, shapes: tuple[tuple[int, ...], ...]) -> "Compressor":
    """The compressor for one bucket, the flattened concatenation of tensors
    of ``shapes`` (in bucket order); :func:`jaxcomp.compressed_mean` calls
    it per bucket. The default ignores the shapes; PowerSGD views each
    tensor as a matrix."""
    del shapes
    return self

  def payload_bytes(self, n: int) -> int:
    """Bytes one device puts on the wire for an ``n``-element buffer.

    This is the sum of the payload arrays' sizes, the formula that tests
    check against the operand bytes of the compiled collectives.
    """
    shapes = jax.eval_shape(lambda x: self.encode(x, jax.random.key(0)),
                            jax.ShapeDtypeStruct((n,), jnp.float32))
    return sum(int(s.size) * s.dtype.itemsize
               for s in jax.tree.leaves(shapes))

  def check_size(self, n: int) -> None:
    """Raises ValueError where this compressor cannot handle ``n`` elements."""
    if n < 1:
      raise ValueError(f"cannot compress an empty buffer, got {n=}")


_REGISTRY: dict[str, Callable[..., Compressor]] = {}


def register(cls):
  """Class decorator: registers a Compressor subclass under ``cls.name``."""
  if not cls.name:
    raise ValueError(f"{cls.__name__} has no name")
  if cls.name in _REGISTRY:
    raise ValueError(f"compressor name {cls.name!r} is already registered")
  _REGISTRY[cls.name] = cls
  return cls


def names() -> list[str]:
  """The registered compressor names, sorted."""
  return sorted(_REGISTRY)


def hyperparameters(name: str) -> tuple[str, ...]:
  """The hyperparameter names the compressor ``name`` takes.

  Raises:
    ValueError: unknown name.
  """
  if name not in _REGISTRY:
    raise ValueError(f"unknown compressor {name!r}; choose one of {names()}")
  return tuple(f.name for f in dataclasses.fields(_REGISTRY[name]) if f.init)


def get(name: str | Compressor, **kwargs) -> Compressor:
  """Builds a compressor from its registry name and hyperparameters.

  Args:
    name: a registered name (see :func:`names`) or a Compressor, returned as
      is (then ``kwargs`` must be empty).
    **kwargs: the compressor's hyperparameters, e.g. ``ratio=0.01``.

  Raises:
    ValueError: unknown name, or a hyperparameter the compressor rejects.
    TypeError: a keyword the compressor does not take.
  """
  if isinstance(name, Compressor):
    if kwargs:
      raise TypeError(
          f"got a Compressor instance and extra keywords {sorted(kwargs)}; "
          "pass either a name with keywords or a built compressor")
    return name
  if not isinstance(name, str) or name not in _REGISTRY:
    raise ValueError(
        f"unknown compressor {name!r}; choose one of {names()}")
  cls = _REGISTRY[name]
  fields = set(hyperparameters(name))
  unknown = sorted(set(kwargs) - fields)
  if unknown:
    raise TypeError(
        f"compressor {name!r} takes {sorted(fields) or 'no parameters'}, "
        f"got unexpected {unknown}")
  return cls(**kwargs)


def check_ratio(ratio, name: str = "ratio") -> None:
  """Validates a ratio in (0, 1] where it is a concrete number."""
  if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
    raise TypeError(f"{name} must be a number in (0, 1], got {ratio!r}")
  if not 0.0 < float(ratio) <= 1.0:
    raise ValueError(f"{name} must be in (0, 1], got {name}={ratio}")


IMPLEMENTATIONS = (None, "pallas", "xla")


def check_implementation(implementation) -> None:
  """Validates a kernel ``implementation`` choice at construction."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"implementation must be 'pallas', 'xla' or None (by backend), got "
        f"{implementation=}")


def num_selected(ratio: float, n: int) -> int:
  """k = ceil(ratio * n), at least 1 and at most n."""
  return max(1, min(n, int(-(-round(ratio * n * 1e6) // 1_000_000))))


def ratio_slots(ratio, max_ratio, n: int) -> int:
  """Static payload slots of a ``ratio`` that may be scheduled:
  ``num_selected(max_ratio, n)`` when ``max_ratio`` is set, else
  ``num_selected(ratio, n)`` (``ratio`` then concrete).

  Raises:
    ValueError: as :func:`_hparams.capacity`.
  """
  return num_selected(
      float(_hparams.capacity(ratio, max_ratio, "ratio", "max_ratio")), n)

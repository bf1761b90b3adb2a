"""The compressor interface and the registry of compressors by name.

A compressor is a pure encode/decode pair over a flat float32 buffer with
static payload shapes (XLA needs them). It knows nothing of collectives: the
collective (``jaxcomp.collectives``) decides how the payloads travel, reading
only the hooks declared on :class:`Compressor` (each with its default there).
A compressor whose exchange is more than one encode / transfer / decode
(PowerSGD, TernGrad, majority vote) sets ``own_exchange`` and receives the
bucket's tensors directly.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, ClassVar, Literal, cast

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp import _parts

from jaxcomp._parts import Parts, Shapes
from jaxcomp._registry import Registry
from jaxcomp.compressors import _hparams

Payload = Any  # a pytree of arrays with static shapes
Randomness = Literal["none", "shared", "independent"]


class Compressor:
  """Base class of all compressors: the whole interface a collective may use.

  Subclasses are frozen dataclasses whose fields are the hyperparameters.
  Every hook below is declared here with its default; collectives read
  nothing else.

  Class attributes:
    name: the registry name (``compressors.get(name, ...)``).
    max_elements: the largest bucket it takes (``check_size``): ``2**31 -
      1``, as element indices are int32; None where no element is
      addressed (identity, the casts).
    vmappable: False when ``encode`` must not run under ``jax.vmap`` inside
      ``shard_map``: a ``lax.cond`` on the data whose branches compute from
      per-device values fails there in JAX 0.10 ("pvary is a
      invariant->variant collective"), so the two-phase exchange encodes
      such a compressor's chunks one after another (``lax.map``) instead of
      at once (threshold, DGC).
    linear: True when ``decode(a) + decode(b) == decode(a + b)`` elementwise on
      payloads (given the same shared randomness), so that ``lax.psum`` can sum
      payloads in flight; False when payloads must be all-gathered and decoded
      one by one.
    biased: True when ``E[decode(encode(x))] != x``; error feedback is then on
      by default in :func:`jaxcomp.compressed_mean`.
    randomness: ``"none"``; ``"shared"`` (the key passed to ``encode`` is the
      same on every device, e.g. random-block); or ``"independent"`` (the key
      differs per device, e.g. QSGD's stochastic rounding).
    prescale: True when the psum collective must divide by the device count
      *before* encoding, so that the sum cannot overflow the payload's type
      (float16, as PyTorch DDP's ``fp16_compress_hook``).
    dense: True for compressors that send every coordinate, summed in
      flight (identity, the casts): a NaN or Inf in any device's buffer
      reaches every device's mean by itself, so a stateless exchange needs
      no non-finite check (``compressed_mean(nonfinite=None)``).
    per_tensor: True for compressors that work on one tensor at a time,
      in its shape (DCT top-k's chunks): :func:`jaxcomp.compressed_mean`
      then needs ``bucketing="layerwise"`` and binds each bucket's shape
      with :meth:`for_shapes`.
    own_exchange: True for compressors whose exchange is not a single
      encode / transfer / decode (PowerSGD's two all-reduces, TernGrad's
      shared scale). They implement :meth:`init_state`, :meth:`exchange` and
      :meth:`transfers`, and ``jaxcomp.collectives.OwnExchange`` runs them;
      ``encode``/``decode`` may then be unused.
  """

  name: ClassVar[str] = ""
  # The largest bucket, in elements: indices, random offsets and element
  # positions are int32 (JAX's default integer), so 2**31 - 1; None where no
  # element is addressed (identity, the casts).
  max_elements: ClassVar[int | None] = 2**31 - 1
  # Whether encode may run under jax.vmap inside shard_map (the two-phase
  # exchange encodes its p chunks at once); see the class docstring.
  vmappable: ClassVar[bool] = True
  linear: ClassVar[bool] = False
  biased: ClassVar[bool] = False
  randomness: ClassVar[Randomness] = "none"
  prescale: ClassVar[bool] = False
  dense: ClassVar[bool] = False
  per_tensor: ClassVar[bool] = False
  own_exchange: ClassVar[bool] = False

  @property
  def default_collective(self) -> str:
    """The collective :func:`jaxcomp.compressed_mean` uses when none is
    named: ``"own_exchange"`` (its own exchange) for ``own_exchange``
    compressors, ``"psum"`` for linear ones (summed in flight by a ring
    all-reduce), ``"allgather"`` for the others. A subclass may name another
    registered collective as a class attribute (the quantizers name
    ``"auto"``: two-phase where it moves fewer bytes)."""
    if self.own_exchange:
      return "own_exchange"
    return "psum" if self.linear else "allgather"

  def encode(self, x: jax.Array, key: jax.Array) -> Payload:
    """Encodes ``x`` (shape ``(n,)``, float32 or the gradient's own
    floating dtype) into a payload pytree. Values that travel as they are
    (identity, the kept entries of sparsifiers) keep ``x``'s dtype."""
    raise NotImplementedError

  def decode(self, payload: Payload, n: int, key: jax.Array) -> jax.Array:
    """Decodes one payload back to float32 of shape ``(n,)``.

    ``key`` is the key ``encode`` was given (shared compressors need it to
    place values; others ignore it).
    """
    raise NotImplementedError

  def decode_sum(self, payloads: Payload, n: int, key: jax.Array) -> jax.Array:
    """Sum of the decodes of stacked payloads (leading axis: devices), float32
    ``(n,)``.

    The default decodes each payload and adds it to a float32 accumulator,
    device 0 first (decoding all payloads under ``vmap`` and reducing over
    the device axis made XLA:CPU run one slow fusion per bucket; in a profile
    of the 2-process QSGD step of ``benchmarks/validate_perfmodel.py`` it took
    most of the step). Sparse payloads override it with one scatter-add.
    """
    p = jax.tree.leaves(payloads)[0].shape[0]
    one = lambda i: self.decode(jax.tree.map(lambda a: a[i], payloads), n,
                                key).astype(jnp.float32)
    if p <= _UNROLL_DECODES:
      acc = one(0)
      for i in range(1, p):
        acc = acc + one(i)
      return acc
    return lax.fori_loop(1, p, lambda i, acc: acc + one(i), one(0))

  def decode_sender_mean(self, payloads: Payload, n: int,
                         key: jax.Array) -> jax.Array:
    """Stacked sparse payloads (leading axis: devices) averaged per
    coordinate over the devices that sent it (0 where none did), float32
    ``(n,)``: what the ``"sender_mean"`` collective returns (DeMo's mean).
    Only compressors that send (value, index) pairs define it."""
    del payloads, n, key
    raise NotImplementedError(
        f"{self.name} sends no (value, index) pairs to average by sender")

  def for_shapes(self, shapes: Shapes) -> Compressor:
    """This compressor for a bucket of tensors of ``shapes`` (a tuple of
    shapes): ``self`` by default; compressors whose encoding depends on a
    tensor's shape (``per_tensor``, DCT top-k's chunks) return a copy bound
    to it.

    Raises:
      ValueError: shapes this compressor cannot bind.
    """
    del shapes
    return self

  def decode_parts(self, payload: Payload, part_sizes, key: jax.Array):
    """:meth:`decode` of a bucket of parts of ``part_sizes`` elements, as
    parts: float32 ``(size_i,)`` arrays, or a :class:`jaxcomp._parts.SparseParts`
    (sparse compressors: their error feedback then scatters what was sent
    into the residual instead of subtracting a dense decode)."""
    return _parts.split(self.decode(payload, sum(part_sizes), key), part_sizes)

  def decode_sum_parts(self, payloads: Payload, part_sizes,
                       key: jax.Array) -> Parts:
    """:meth:`decode_sum` as dense float32 parts of ``part_sizes``."""
    return _parts.split(self.decode_sum(payloads, sum(part_sizes), key),
                        part_sizes)

  def payload_arrays(self, n: int, dtype=jnp.float32) -> tuple[int, ...]:
    """Bytes of each array of the payload of an ``n``-element buffer of
    ``dtype``, in ``jax.tree.leaves`` order (each travels as its own
    collective), from the shapes ``encode`` returns (traced once per
    compressor, size and dtype: the performance model asks for thousands
    of bucket sizes)."""
    try:
      return _payload_arrays_cached(self, int(n), jnp.dtype(dtype))
    except TypeError:  # a traced (scheduled) hyperparameter: not hashable
      return _payload_arrays(self, int(n), jnp.dtype(dtype))

  def payload_bytes(self, n: int) -> int:
    """Bytes one device puts on the wire for an ``n``-element buffer.

    This is the sum of the payload arrays' sizes; subclasses state it as a
    formula, which tests check against the operand bytes of the compiled
    collectives.
    """
    return sum(self.payload_arrays(n))

  def check_size(self, n: int) -> None:
    """Raises ValueError where this compressor cannot handle ``n`` elements:
    none, or more than :attr:`max_elements`."""
    if n < 1:
      raise ValueError(f"cannot compress an empty buffer, got {n=}")
    if self.max_elements is not None and n > self.max_elements:
      raise ValueError(
          f"compressor {self.name!r} cannot take a bucket of {n=} elements: "
          "it addresses elements with int32 indices, so a bucket holds at "
          f"most 2**31 - 1 = {self.max_elements}. Leave leaves this large "
          "out of compression (compressed_mean(mask=...) averages them "
          "exactly), use 'identity' or a cast for them, or shard them first "
          "(jaxcomp.fsdp)")

  # -- own_exchange compressors -------------------------------------------

  def init_state(self, shapes: Shapes, key: jax.Array, axis_name) -> Any:
    """State of one bucket of tensors of ``shapes`` (``own_exchange`` only).

    Called inside shard_map/pmap with a key derived from the transform's
    seed (the same on every device); per-device leaves must be created
    varying over ``axis_name``, shared ones invariant.
    """
    del shapes, key, axis_name
    return ()

  def exchange(self, parts: Parts, shapes: Shapes, *, key: jax.Array,
               step: jax.Array, axis_name, state: Any
               ) -> tuple[Parts, Parts, Any]:
    """``own_exchange`` compressors: one bucket's exchange, returning
    ``(mean, local, state)`` per tensor as
    :meth:`jaxcomp.collectives.Collective.exchange` does; ``step`` is the
    transform's int32 step count."""
    raise NotImplementedError(f"{self.name} has no exchange of its own")

  def transfers(self, shapes: Shapes, sizes: dict[str, int],
                dtype=jnp.float32):
    """``own_exchange`` compressors: the collectives one bucket's exchange
    of a gradient of ``dtype`` issues, as :class:`jaxcomp.wire.Transfer` s,
    over the axes of ``sizes`` (``{axis: devices}``)."""
    raise NotImplementedError(f"{self.name} has no exchange of its own")

  def buffer_transfers(self, n: int, sizes: dict[str, int], dtype=jnp.float32):
    """``own_exchange`` compressors: :meth:`transfers` for one flat
    ``n``-element buffer, where no tensor shapes are known (what the
    performance model prices); by default the transfers of one tensor of
    shape ``(n,)``."""
    return self.transfers(((n,),), sizes, dtype)


_UNROLL_DECODES = 16  # beyond this many devices, decode in a loop


def _payload_arrays(compressor: Compressor, n: int, dtype) -> tuple[int, ...]:
  shapes = jax.eval_shape(lambda x: compressor.encode(x, jax.random.key(0)),
                          jax.ShapeDtypeStruct((n,), dtype))
  return tuple(int(s.size) * s.dtype.itemsize for s in jax.tree.leaves(shapes))


_payload_arrays_cached = functools.lru_cache(maxsize=1 << 14)(_payload_arrays)


REGISTRY: Registry[Compressor] = Registry("compressor")
register = REGISTRY.register
names = REGISTRY.names


def hyperparameters(name: str) -> tuple[str, ...]:
  """The hyperparameter names the compressor ``name`` takes.

  Raises:
    ValueError: unknown name.
  """
  cls = cast(Any, REGISTRY.lookup(name))  # compressors are dataclasses
  return tuple(f.name for f in dataclasses.fields(cls) if f.init)


def get(name: str | Compressor, **kwargs) -> Compressor:
  """Builds a compressor from its registry name and hyperparameters.

  Args:
    name: a registered name (see :func:`names`) or a Compressor, returned as
      is (then ``kwargs`` must be empty).
    **kwargs: the compressor's hyperparameters, e.g. ``ratio=0.01``.

  Raises:
    ValueError: unknown name, or a hyperparameter the compressor rejects.
    TypeError: a keyword the compressor does not take.

  Example:
    >>> from jaxcomp import compressors
    >>> comp = compressors.get("topk", ratio=0.01)
    >>> comp.payload_bytes(10_000)  # 100 float32 values, 100 int32 indices
    800
  """
  if isinstance(name, Compressor):
    if kwargs:
      raise TypeError(
          f"got a Compressor instance and extra keywords {sorted(kwargs)}; "
          "pass either a name with keywords or a built compressor")
    return name
  cls = REGISTRY.lookup(name)
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

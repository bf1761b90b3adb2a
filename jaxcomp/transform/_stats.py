"""Traffic statistics of a compressed exchange, carried in the state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp import wire
from jaxcomp._mesh import AxisName


class CompressionStats(NamedTuple):
  """One transform's statistics of one exchange, carried in its state
  (read with :func:`get_stats`, which adds the exchange's axes and
  cadence: :class:`ExchangeStats`).

  Two measures of one exchange's traffic (one call of the transform's
  ``update``: every step, or per sync where the transform is DiLoCo's),
  per device, each with the dense exchange of the same gradient beside it
  (:func:`dense_bytes_of`):

  * operand bytes (``bytes_sent``, ``dense_bytes``): what this device hands
    to collectives (the compressor payloads plus the exact leaves), what
    compression shrinks and what :func:`jaxcomp.collective_traffic` reads
    as ``operand_bytes``;
  * wire bytes (``wire_bytes``, ``dense_wire_bytes``): what this device
    sends over the links by the ring algorithms for its collectives and
    device count (:mod:`jaxcomp.wire`; ``Traffic.ring_bytes``). All-gather
    based exchanges grow with the device count here, so this is the basis
    on which to compare with a dense all-reduce: on 8 devices top-k at 1%
    is 50x fewer operand bytes but 12.5x fewer wire bytes.

  A compression factor is dense over compressed (higher is fewer bytes).
  The non-finite flag (one scalar all-reduce) is not counted.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = jaxcomp.compressed_mean("topk", "data", ratio=0.1)
    >>> state = jaxcomp.init(tx, {"w": jnp.zeros((8, 4))}, mesh)
    >>> stats = jaxcomp.get_stats(state.opt_state)  # its ExchangeStats
    >>> float(stats.compression_factor), float(stats.wire_compression_factor)
    (4.0, 1.0)
  """

  bytes_sent: jax.Array  # shape=(), float32, operand bytes per device per
  #                        exchange
  dense_bytes: jax.Array  # shape=(), float32, the dense exchange's operand
  #                         bytes (dense_bytes_of)
  compression_factor: jax.Array  # shape=(), float32, dense_bytes / bytes_sent
  wire_bytes: jax.Array  # shape=(), float32, ring bytes per device per
  #                        exchange
  dense_wire_bytes: jax.Array  # shape=(), float32, the dense exchange's
  wire_compression_factor: jax.Array  # shape=(), float32, dense_wire / wire
  residual_norm: jax.Array  # shape=(), float32, this device's L2 residual
  skipped_steps: jax.Array  # shape=(), int32, steps skipped for non-finite
  state_bytes: jax.Array  # shape=(), float32, bytes of per-device state
  #                         (error feedback, the collective's) on each device


def dense_bytes_of(sizes: Sequence[int], dtypes: Sequence) -> int:
  """``dense_bytes``, the one definition: the bytes one device hands to the
  dense exchange of the same gradient, per exchange.

  ``dense_bytes = sum_i sizes[i] * dtypes[i].itemsize`` over the leaves the
  exchange averages (leaves it passes through, e.g. integer ones, are not
  counted): the operand of one exact ``lax.pmean`` of the gradient in its
  own dtypes (float32: 4 bytes an element, bfloat16: 2), or of one
  ``lax.psum_scatter`` where the exchange reduce-scatters
  (``output="shard"``: ``sizes`` are then the leaves' whole sizes, padded
  to a multiple of the device count). Operand bytes, as ``bytes_sent``
  counts them; the dense exchange's bytes on the links, by the ring
  algorithms, are ``dense_wire_bytes = jaxcomp.wire.ring_bytes(kind,
  dense_bytes, p)`` (for an all-reduce ``2 (p - 1) / p * dense_bytes``).

  Args:
    sizes: elements per leaf.
    dtypes: each leaf's dtype.

  Returns:
    Bytes (a Python int).
  """
  return sum(int(n) * np.dtype(d).itemsize for n, d in zip(sizes, dtypes))


def traffic_figures(transfers, p: int, *, exact_bytes: int, dense_bytes: int,
                    dense_kind: str, state_bytes: int) -> dict[str, float]:
  """The static fields of :class:`CompressionStats` as Python floats, for an
  exchange issuing ``transfers`` plus ``exact_bytes`` sent densely by a
  ``dense_kind`` collective over ``p`` devices, against ``dense_bytes`` sent
  that way; ``state_bytes`` of per-device state. Plain numbers, so that a
  transform computes them once per bucket plan and reuses them in any trace."""
  sent = wire.operand_bytes(transfers) + exact_bytes
  on_wire = (wire.total_ring_bytes(transfers)
             + wire.ring_bytes(dense_kind, exact_bytes, p))
  dense_wire = wire.ring_bytes(dense_kind, dense_bytes, p)
  return dict(bytes_sent=float(sent), dense_bytes=float(dense_bytes),
              compression_factor=float(dense_bytes / max(sent, 1)),
              wire_bytes=float(on_wire), dense_wire_bytes=float(dense_wire),
              wire_compression_factor=float(
                  dense_wire / on_wire if on_wire else 1.0),
              state_bytes=float(state_bytes))


def as_arrays(figures: dict[str, float]) -> dict[str, jax.Array]:
  """:func:`traffic_figures` as the float32 scalars the state holds."""
  return {k: jnp.asarray(v, jnp.float32) for k, v in figures.items()}


def traffic_stats(transfers, p: int, *, exact_bytes: int, dense_bytes: int,
                  dense_kind: str, state_bytes: int) -> dict:
  """The static fields of :class:`CompressionStats` (float32 scalars) for an
  exchange issuing ``transfers`` plus ``exact_bytes`` sent densely by a
  ``dense_kind`` collective over ``p`` devices, against ``dense_bytes`` sent
  that way; ``state_bytes`` of per-device state."""
  return as_arrays(traffic_figures(
      transfers, p, exact_bytes=exact_bytes, dense_bytes=dense_bytes,
      dense_kind=dense_kind, state_bytes=state_bytes))


class ExchangeStats(NamedTuple):
  """The statistics of one exchange, as :func:`get_stats` returns them: the
  fields of :class:`CompressionStats` (totalled over the transforms that
  make up the exchange) after the exchange's axes, dense collective and
  cadence.

  Bytes are per device *per exchange*: an exchange with ``every > 1`` (DiLoCo's
  sync) sends ``bytes_sent`` once per ``every`` steps, ``bytes_sent /
  every`` on average per step. Exchanges of different cadences or axes are
  never summed into one number.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = jaxcomp.diloco(optax.sgd(0.1), sync_every=50, compressor="bf16")
    >>> state = jaxcomp.init(tx, {"w": jnp.zeros(100)}, mesh,
    ...                      layout=jaxcomp.Islands())
    >>> s = jaxcomp.get_stats(state.opt_state)  # 100 bf16 values, once per 50 steps
    >>> s.axis_name, s.collective, s.every, float(s.bytes_sent)
    ('data', 'all-reduce', 50, 200.0)
    >>> float(s.bytes_sent) / s.every  # a step's average
    4.0
  """

  axis_name: AxisName | None  # the axes it averages over (None: a state
  #                             that does not say)
  collective: str  # the dense exchange it stands for: "all-reduce", or
  #                  "reduce-scatter" (output="shard", FSDP)
  every: int  # steps per exchange (calls of the train step): 1 every
  #             step; DiLoCo's sync_every; times multi_steps' every_k
  bytes_sent: jax.Array  # shape=(), float32, operand bytes per device per
  #                        exchange
  dense_bytes: jax.Array  # shape=(), float32, dense_bytes_of the gradient
  compression_factor: jax.Array  # shape=(), float32, dense_bytes / bytes_sent
  wire_bytes: jax.Array  # shape=(), float32, ring bytes per device per
  #                        exchange
  dense_wire_bytes: jax.Array  # shape=(), float32, the dense exchange's
  wire_compression_factor: jax.Array  # shape=(), float32, dense_wire / wire
  residual_norm: jax.Array  # float32, the L2 residual (per device where the
  #                           state is)
  skipped_steps: jax.Array  # shape=(), int32, exchanges skipped for
  #                           non-finite gradients
  state_bytes: jax.Array  # shape=(), float32, bytes of per-device state

  @property
  def name(self) -> str:
    """The exchange's key in ``get_stats(..., by_exchange=True)``: its axis
    name, several axes joined by ``","``."""
    axes = self.axis_name
    return ",".join(axes) if isinstance(axes, tuple) else str(axes)


def _has_stats(x) -> bool:
  """Whether ``x`` is a transform state carrying :class:`CompressionStats`
  in a ``stats`` field (``compressed_mean``'s, ``jaxcomp.demo``'s)."""
  return isinstance(x, tuple) and isinstance(getattr(x, "stats", None),
                                             CompressionStats)


def _exchange_of(x) -> ExchangeStats:
  """The :class:`ExchangeStats` of one transform state ``x`` (its axes,
  output and cadence from its configuration, where it has one)."""
  config = getattr(x, "config", None)
  axis_name, collective, every = None, "all-reduce", 1
  if config is not None:
    described = config.as_dict()
    axes = described.get("axis_name")
    axis_name = tuple(axes) if isinstance(axes, list) else axes
    if described.get("output") == "shard":
      collective = "reduce-scatter"
    every = int(config.every) * int(config.micro_steps)
  return ExchangeStats(axis_name, collective, every, **x.stats._asdict())


def _total(found: list[ExchangeStats]) -> ExchangeStats:
  """One exchange made of several transforms (e.g. a ``multi_transform``'s
  over one axis): bytes and skipped steps add up, the factors are the
  totals' quotients, the residual norms combine as the norm of the
  concatenated residuals (per device where they have one placement)."""
  if len(found) == 1:
    return found[0]
  total = lambda f: sum(getattr(s, f) for s in found)
  norms = [s.residual_norm for s in found]
  if len({jnp.shape(r) for r in norms}) == 1:
    residual = jnp.sqrt(sum(r ** 2 for r in norms))
  else:
    residual = jnp.sqrt(sum(jnp.sum(r ** 2) for r in norms))
  sent, dense = total("bytes_sent"), total("dense_bytes")
  on_wire, dense_wire = total("wire_bytes"), total("dense_wire_bytes")
  return found[0]._replace(
      bytes_sent=sent, dense_bytes=dense,
      compression_factor=dense / jnp.maximum(sent, 1.0),
      wire_bytes=on_wire, dense_wire_bytes=dense_wire,
      wire_compression_factor=jnp.where(
          on_wire > 0, dense_wire / jnp.maximum(on_wire, 1.0), 1.0),
      residual_norm=residual,
      skipped_steps=total("skipped_steps"), state_bytes=total("state_bytes"))


def _by_exchange(found: list[ExchangeStats]) -> dict[str, ExchangeStats]:
  """``found`` grouped into exchanges (same axes, collective and cadence),
  each totalled, keyed by name in tree order."""
  groups: dict[tuple, list[ExchangeStats]] = {}
  for s in found:
    groups.setdefault((s.axis_name, s.collective, s.every), []).append(s)
  out: dict[str, ExchangeStats] = {}
  for members in groups.values():
    s = _total(members)
    if s.name in out:
      raise ValueError(
          f"two exchanges over {s.axis_name!r} differ in collective or "
          f"cadence ({out[s.name].collective} every {out[s.name].every} "
          f"steps, {s.collective} every {s.every}): read each transform's "
          "statistics with get_stats(state, by_path=True)")
    out[s.name] = s
  return out


def _describe(s: ExchangeStats) -> str:
  when = "every step" if s.every == 1 else f"every {s.every} steps"
  return f"{s.name!r}: {s.collective} {when}"


def get_stats(state, *, by_exchange: bool = False, by_path: bool = False):
  """The statistics of the exchanges of the :func:`compressed_mean`
  transforms (and :func:`jaxcomp.demo`, :func:`jaxcomp.diloco`) in an
  optimizer state (e.g. the state of an ``optax.chain``, a
  ``multi_transform`` or a :func:`jaxcomp.multi_steps`), each exchange
  with its cadence.

  An *exchange* is what the transforms averaging over the same axes, with
  the same dense collective, at the same cadence send together: one
  ``compressed_mean`` in a chain is one; a ``multi_transform`` of two over
  ``"data"`` is one (their bytes add up); a DiLoCo run with an exact mean
  inside each island (every step, over ``"data"``) and the compressed sync
  across islands (every ``sync_every`` steps, over ``"hosts"``) is two, as
  HSDP's reduce-scatter over ``"devices"`` and mean over ``"hosts"`` are.
  Bytes are per device per exchange (:class:`ExchangeStats`); exchanges of
  different cadences or axes are never summed.

  Args:
    state: an optimizer state (global or per-device view).
    by_exchange: return every exchange, by name.
    by_path: return each transform's statistics by its path in ``state``.

  Returns:
    By default the :class:`ExchangeStats` of the state's one exchange, or
    None if there is none. With ``by_exchange=True``: ``{name:
    ExchangeStats}``, the name the exchange's axis name (several axes
    joined by ``","``), in tree order. With ``by_path=True``: ``{path
    string: ExchangeStats}`` of each transform, in tree order.

  Raises:
    ValueError: the state holds several exchanges and neither
      ``by_exchange`` nor ``by_path`` was asked for (the message lists
      them); with ``by_exchange``, two exchanges over the same axes that
      differ in collective or cadence (read them ``by_path``); both
      ``by_exchange`` and ``by_path``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = optax.chain(jaxcomp.compressed_mean("topk", "data", ratio=0.1),
    ...                  optax.sgd(0.1))
    >>> state = jaxcomp.init(tx, {"w": jnp.zeros((8, 4))}, mesh)
    >>> stats = jaxcomp.get_stats(state.opt_state)  # 4 values + 4 indices, each step
    >>> stats.axis_name, stats.every, float(stats.bytes_sent)
    ('data', 1, 32.0)
    >>> float(stats.dense_bytes), float(stats.compression_factor)
    (128.0, 4.0)
    >>> list(jaxcomp.get_stats(state.opt_state, by_path=True))  # by the chain's index
    ['[0]']

    DiLoCo across 2 islands, an exact float32 mean inside each island
    every step and an int8 sync across islands every 50 steps (1024 int8
    values and a float32 scale per block of 256): two exchanges.

    >>> mesh = jax.make_mesh((2, jax.device_count() // 2), ("hosts", "data"))
    >>> tx = jaxcomp.diloco(optax.chain(
    ...     jaxcomp.compressed_mean("identity", "data"), optax.sgd(0.1)),
    ...     sync_every=50, compressor="int8_block", axis_name="hosts")
    >>> state = jaxcomp.init(tx, {"w": jnp.zeros(1024)}, mesh,
    ...                      layout=jaxcomp.Islands(over="hosts"),
    ...                      axis_name=("hosts", "data"))
    >>> {k: (s.every, float(s.bytes_sent), float(s.dense_bytes))
    ...  for k, s in jaxcomp.get_stats(state.opt_state, by_exchange=True).items()}
    {'data': (1, 4096.0, 4096.0), 'hosts': (50, 1040.0, 4096.0)}
  """
  if by_exchange and by_path:
    raise ValueError("get_stats takes by_exchange or by_path, not both")
  found = []

  def visit(path, x):
    if _has_stats(x):
      found.append((jax.tree_util.keystr(path), _exchange_of(x)))

  jax.tree_util.tree_map_with_path(visit, state, is_leaf=_has_stats)
  if by_path:
    return dict(found)
  exchanges = _by_exchange([s for _, s in found])
  if by_exchange:
    return exchanges
  if len(exchanges) > 1:
    raise ValueError(
        f"this state holds {len(exchanges)} exchanges ("
        + "; ".join(_describe(s) for s in exchanges.values())
        + "), whose bytes move at different cadences or over different "
        "links and are not summed: read them with get_stats(state, "
        "by_exchange=True)")
  return next(iter(exchanges.values()), None)

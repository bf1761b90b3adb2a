"""Traffic statistics carried in the state: of a compressed exchange
(`compressed_mean`'s), and of the compressed optimizers' phases."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.core
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


class OneBitStats(NamedTuple):
  """Traffic of DeepSpeed's compressed optimizers (:func:`jaxcomp.onebit_adam`,
  :func:`jaxcomp.zero_one_adam`, :func:`jaxcomp.onebit_lamb`), by phase,
  carried in their states (read with :func:`get_stats`, which returns a
  :class:`OneBitTraffic`).

  Per device. A dense step's bytes and a 1-bit exchange's bytes are each
  one exchange's; the counters say how many of each the run made, so the
  cadence (warm-up, then 1-bit; 0/1 Adam's skipped rounds) is read apart
  from the sizes, never summed into one per-step figure here. Operand
  bytes are what the device hands to collectives; wire bytes what it sends
  by the ring algorithms (:mod:`jaxcomp.wire`).
  """

  dense_bytes: jax.Array  # shape=(), float32, operand bytes of one dense
  #                         exchange (the all-reduce of the gradient)
  dense_wire_bytes: jax.Array  # shape=(), float32, its ring bytes
  compressed_bytes: jax.Array  # shape=(), float32, operand bytes of one
  #                              1-bit exchange
  compressed_wire_bytes: jax.Array  # shape=(), float32, its ring bytes
  dense_steps: jax.Array  # shape=(), int32, steps that exchanged densely
  compressed_steps: jax.Array  # shape=(), int32, 1-bit exchanges made
  state_bytes: jax.Array  # shape=(), float32, bytes of this device's own
  #                         state (worker and server errors)
  skipped_steps: jax.Array  # shape=(), int32, steps skipped under
  #                           nonfinite="skip" because some device's
  #                           gradient held a NaN or Inf (the only field
  #                           such a step changes)


class OneBitTraffic(NamedTuple):
  """What a run of a compressed optimizer has sent so far, per device, in
  Python numbers, phase by phase: :func:`get_stats` of a state holding
  :func:`jaxcomp.onebit_adam`, :func:`jaxcomp.zero_one_adam` or
  :func:`jaxcomp.onebit_lamb` (read from its :class:`OneBitStats` and its
  step count), and :func:`jaxcomp.perfmodel.optimizer_traffic`'s price of
  a run. Bytes are operand bytes (handed to collectives) unless named wire
  bytes (sent over the links by the ring algorithms, :mod:`jaxcomp.wire`).

  The totals count the dense exchanges and the 1-bit exchanges only:
  ``total_bytes = dense_steps * dense_bytes_per_exchange + compressed_steps
  * compressed_bytes_per_exchange`` (wire bytes likewise), and the dense
  comparison prices the steps taken (``dense_steps + compressed_steps +
  silent_steps``) as dense. Neither counts the non-finite check of
  ``nonfinite="skip"`` (one 4-byte all-reduce on every step) nor the
  ``skipped_steps``, on which that check is all a device sends.

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> tx = jaxcomp.onebit_adam(1e-3, axis_name="data", freeze_step=10)
    >>> state = jaxcomp.init(tx, {"w": jnp.zeros((4096,))}, mesh)
    >>> t = jaxcomp.get_stats(state.opt_state)  # no step yet
    >>> t.dense_bytes_per_exchange, t.compressed_bytes_per_exchange
    (16384.0, 584.0)
    >>> t.dense_steps, t.compressed_steps, t.silent_steps, t.skipped_steps
    (0, 0, 0, 0)
    >>> t.total_bytes
    0.0
  """

  dense_steps: int  # steps with a dense all-reduce (warm-up, 0/1 Adam's
  #                   variance steps)
  compressed_steps: int  # 1-bit exchanges
  silent_steps: int  # steps that sent nothing (0/1 Adam's local steps)
  skipped_steps: int  # steps skipped for a non-finite gradient
  #                     (nonfinite="skip"): each sent only the 4-byte
  #                     check, in no byte total; not among the steps taken
  dense_bytes_per_exchange: float  # operand bytes of one dense step
  compressed_bytes_per_exchange: float  # operand bytes of one 1-bit exchange
  total_bytes: float  # operand bytes of the run so far, warm-up included
  total_wire_bytes: float  # ring bytes of the run so far
  dense_total_bytes: float  # operand bytes had every step been dense
  dense_total_wire_bytes: float
  reduction: float  # dense_total_bytes / total_bytes (1 before any step)
  wire_reduction: float  # dense_total_wire_bytes / total_wire_bytes

  @classmethod
  def of(cls, *, dense_steps: int, compressed_steps: int, steps: int,
         skipped_steps: int, dense: tuple[float, float],
         compressed: tuple[float, float]) -> OneBitTraffic:
    """The traffic of ``steps`` steps taken, ``dense_steps`` of them dense
    and ``compressed_steps`` 1-bit exchanges (the rest sent nothing), and
    of ``skipped_steps`` more skipped for a non-finite gradient (in no
    total), from the (operand, ring) bytes of one ``dense`` step and of
    one ``compressed`` exchange."""
    (db, dw), (cb, cw) = dense, compressed
    total = dense_steps * db + compressed_steps * cb
    total_wire = dense_steps * dw + compressed_steps * cw
    return cls(
        dense_steps=dense_steps, compressed_steps=compressed_steps,
        silent_steps=steps - dense_steps - compressed_steps,
        skipped_steps=skipped_steps,
        dense_bytes_per_exchange=db, compressed_bytes_per_exchange=cb,
        total_bytes=total, total_wire_bytes=total_wire,
        dense_total_bytes=steps * db, dense_total_wire_bytes=steps * dw,
        reduction=steps * db / total if total else 1.0,
        wire_reduction=steps * dw / total_wire if total_wire else 1.0)


def _has_phases(x) -> bool:
  """Whether ``x`` is a compressed optimizer's state, carrying
  :class:`OneBitStats` in a ``stats`` field."""
  return isinstance(x, tuple) and isinstance(getattr(x, "stats", None),
                                             OneBitStats)


def _phases_of(x) -> OneBitTraffic:
  """The :class:`OneBitTraffic` of one compressed optimizer's state ``x``
  (global view): its counters, its bytes, the steps it took (``count``).
  Reads the arrays to Python numbers: outside ``jit``."""
  if isinstance(x.count, jax.core.Tracer):
    raise ValueError("get_stats reads a compressed optimizer's counters as "
                     "Python numbers: call it outside jit")
  get = lambda a: jax.device_get(a)
  stats = x.stats
  return OneBitTraffic.of(
      dense_steps=int(get(stats.dense_steps)),
      compressed_steps=int(get(stats.compressed_steps)),
      steps=int(get(x.count)),
      skipped_steps=int(get(stats.skipped_steps)),
      dense=(float(get(stats.dense_bytes)), float(get(stats.dense_wire_bytes))),
      compressed=(float(get(stats.compressed_bytes)),
                  float(get(stats.compressed_wire_bytes))))


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


def _phases_report(items, exchanges: dict[str, ExchangeStats],
                   by_exchange: bool) -> OneBitTraffic:
  """The one compressed optimizer's report of a state whose ``items``
  (``(path, state)`` in tree order) hold compressed optimizers, or the
  ValueError that sends the caller to ``by_path``."""
  paths = [k or "the root" for k, x in items if _has_phases(x)]
  if by_exchange:
    raise ValueError(
        f"this state holds a compressed optimizer (at {', '.join(paths)}), "
        "whose phases are not an exchange of one cadence: read it with "
        "get_stats(state), or everything with get_stats(state, by_path=True)")
  if exchanges:
    raise ValueError(
        "this state holds compressed_mean exchanges ("
        + "; ".join(_describe(s) for s in exchanges.values())
        + f") and a compressed optimizer's phases (at {', '.join(paths)}), "
        "which are not summed: read each with get_stats(state, by_path=True)")
  if len(paths) > 1:
    raise ValueError(
        f"this state holds {len(paths)} compressed optimizers (at "
        f"{', '.join(paths)}): read each with get_stats(state, by_path=True)")
  return _phases_of(next(x for _, x in items if _has_phases(x)))


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

  A compressed optimizer (:func:`jaxcomp.onebit_adam`,
  :func:`jaxcomp.zero_one_adam`, :func:`jaxcomp.onebit_lamb`) owns its
  exchange and changes it by phase (dense warm-up, 1-bit exchanges, 0/1
  Adam's steps that send nothing): for it ``get_stats`` returns the run so
  far, phase by phase (:class:`OneBitTraffic`, Python numbers read from
  the state's counters: call it outside ``jit``).

  Args:
    state: an optimizer state (global or per-device view; the global view
      where it holds a compressed optimizer).
    by_exchange: return every exchange, by name.
    by_path: return each transform's statistics (each compressed
      optimizer's report) by its path in ``state``.

  Returns:
    By default the :class:`ExchangeStats` of the state's one exchange, the
    :class:`OneBitTraffic` of its one compressed optimizer, or None if
    there is neither. With ``by_exchange=True``: ``{name:
    ExchangeStats}``, the name the exchange's axis name (several axes
    joined by ``","``), in tree order. With ``by_path=True``: ``{path
    string: ExchangeStats or OneBitTraffic}`` of each transform and
    compressed optimizer, in tree order.

  Raises:
    ValueError: the state holds several exchanges and neither
      ``by_exchange`` nor ``by_path`` was asked for (the message lists
      them); with ``by_exchange``, two exchanges over the same axes that
      differ in collective or cadence (read them ``by_path``); a
      compressed optimizer beside a ``compressed_mean`` or another
      compressed optimizer, or with ``by_exchange`` (read them
      ``by_path``); a compressed optimizer's state inside ``jit``; both
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

    1-bit Adam, 3 dense steps then 1-bit exchanges (one leaf of 4096
    float32 values over 8 devices: 16384 bytes dense, 584 in 1 bit).

    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> tx = jaxcomp.onebit_adam(1e-3, axis_name="data", freeze_step=3)
    >>> state = jaxcomp.init(tx, {"w": jnp.zeros(4096)}, mesh)
    >>> step = jaxcomp.make_train_step(
    ...     lambda p, x: jnp.sum((p["w"] - x[0]) ** 2), tx, mesh=mesh)
    >>> batch = jax.device_put(jnp.ones((8, 4096)),
    ...                        NamedSharding(mesh, P("data")))
    >>> for _ in range(5):
    ...   state, _ = step(state, batch)
    >>> t = jaxcomp.get_stats(state.opt_state)
    >>> t.dense_steps, t.compressed_steps, t.total_bytes
    (3, 2, 50320.0)

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
  items = []
  is_leaf = lambda x: _has_stats(x) or _has_phases(x)

  def visit(path, x):
    if is_leaf(x):
      items.append((jax.tree_util.keystr(path), x))

  jax.tree_util.tree_map_with_path(visit, state, is_leaf=is_leaf)
  if by_path:
    return {k: _exchange_of(x) if _has_stats(x) else _phases_of(x)
            for k, x in items}
  exchanges = _by_exchange([_exchange_of(x) for _, x in items
                            if _has_stats(x)])
  if any(_has_phases(x) for _, x in items):
    return _phases_report(items, exchanges, by_exchange)
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

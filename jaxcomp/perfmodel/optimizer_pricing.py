"""DeepSpeed's compressed optimizers (:func:`jaxcomp.onebit_adam`,
:func:`jaxcomp.zero_one_adam`, :func:`jaxcomp.onebit_lamb`) for the model.

Each optimizer runs three kinds of step, and a run is priced as the
average over its steps of each kind:

* a dense step (1-bit Adam's and 1-bit LAMB's warm-up, 0/1 Adam's
  variance steps): the float32 all-reduce of every gradient, priced as the
  dense baseline (:class:`~jaxcomp.perfmodel.DenseCompressor` with the same
  buckets and overlap);
* a 1-bit step: the backward pass, then one 1-bit exchange of the momentum
  (an all-to-all of packed signs and three all-gathers of signs and
  scales, :func:`jaxcomp.optimizers.phase_transfers`), which starts after
  the optimizer has the whole gradient and so overlaps nothing;
* a skipped round (0/1 Adam's local steps between synchronisations): the
  compute alone.

How many of each a run of ``steps`` steps takes follows the optimizer's
own schedule (:func:`optimizer_phases`), and the bytes are the ones
:func:`jaxcomp.get_stats` counts for that run
(:func:`optimizer_traffic`).

References:
  Tang et al., 1-bit Adam <https://arxiv.org/abs/2102.02888>, ICML 2021;
  Lu et al., 0/1 Adam <https://arxiv.org/abs/2202.06009>, ICLR 2023; Li et
  al., 1-bit LAMB <https://arxiv.org/abs/2104.06069>, HiPC 2022.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Sequence

from jaxcomp import optimizers
from jaxcomp import wire
from jaxcomp.transform import OneBitTraffic
from jaxcomp.perfmodel import costs
from jaxcomp.perfmodel.pricing import CodecCost

__all__ = ["CompressedOptimizer", "OPTIMIZERS", "optimizer_phases",
           "optimizer_traffic"]

OPTIMIZERS = ("onebit_adam", "zero_one_adam", "onebit_lamb")


@dataclasses.dataclass(frozen=True)
class CompressedOptimizer:
  """A run of one of DeepSpeed's compressed optimizers, for
  :func:`jaxcomp.perfmodel.predict` and ``jaxcomp whatif -c``.

  Attributes:
    name: ``"onebit_adam"``, ``"zero_one_adam"`` or ``"onebit_lamb"``.
    steps: training steps of the run (the average is over these).
    freeze_step: the optimizer's ``freeze_step`` (0/1 Adam: its
      ``var_freeze_step``). Default: 15% of ``steps`` (the 1-bit Adam
      paper's 15-25%; assumed).
    var_update_scaler, local_step_scaler, local_step_clipper: 0/1 Adam's
      (the defaults are :func:`jaxcomp.zero_one_adam`'s).

  Raises:
    ValueError: an unknown name or a step count that is not an integer
      >= 1.
  """

  name: str
  steps: int = 100_000
  freeze_step: int | None = None
  var_update_scaler: int = 16
  local_step_scaler: int = 32678
  local_step_clipper: int = 16
  linear = False
  own_exchange = True

  def __post_init__(self):
    if self.name not in OPTIMIZERS:
      raise ValueError(f"name must be one of {OPTIMIZERS}, got {self.name!r}")
    if self.freeze_step is None:
      object.__setattr__(self, "freeze_step",
                         max(1, round(0.15 * _int("steps", self.steps))))
    for f in ("steps", "freeze_step", "var_update_scaler",
              "local_step_scaler", "local_step_clipper"):
      _int(f, getattr(self, f))

  @property
  def fused(self) -> bool:
    """1-bit LAMB exchanges all its leaves as one buffer."""
    return self.name == "onebit_lamb"

  def payload_bytes(self, n: int) -> int:
    """Operand bytes of one 1-bit exchange of an ``n``-element buffer (for
    the codec tables, which read a compressor's payload)."""
    return wire.operand_bytes(optimizers.phase_transfers(
        [int(n)], {"data": 8})["compressed"])


def _int(name: str, v) -> int:
  if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
    raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
  return int(v)


@functools.lru_cache(maxsize=64)
def optimizer_phases(opt: CompressedOptimizer) -> tuple[int, int, int]:
  """``(dense, onebit, skipped)``: the steps of a run of ``opt`` that
  all-reduce densely, that make one 1-bit exchange, and that send nothing,
  by the optimizer's schedule (0/1 Adam's: variance steps at intervals
  that double after ``var_update_scaler`` of them, 1-bit steps between;
  after the freeze, syncs at intervals that double after
  ``local_step_scaler`` frozen steps, up to ``local_step_clipper``)."""
  steps, freeze = opt.steps, opt.freeze_step
  assert freeze is not None  # set by __post_init__
  if opt.name != "zero_one_adam":
    dense = min(steps, freeze)
    return dense, steps - dense, 0
  dense = onebit = 0
  var_interval, var_counter, local_interval, local_counter = 1, 0, 1, 0
  for k in range(1, steps + 1):
    if k <= freeze:
      if k % var_interval == 0:
        dense += 1
        var_counter += 1
        if var_counter == opt.var_update_scaler:
          var_counter, var_interval = 0, 2 * var_interval
      else:
        onebit += 1
    else:
      onebit += k % local_interval == 0
      local_counter += 1
      if local_counter == opt.local_step_scaler:
        local_counter = 0
        local_interval = min(opt.local_step_clipper, 2 * local_interval)
  return dense, onebit, steps - dense - onebit


@functools.lru_cache(maxsize=64)
def _transfers(sizes: tuple[int, ...], workers: int, fused: bool) -> dict:
  return optimizers.phase_transfers(list(sizes), {"data": workers},
                                    fused=fused)


def optimizer_traffic(opt: CompressedOptimizer, sizes: Sequence[int],
                      workers: int) -> OneBitTraffic:
  """What a run of ``opt`` sends per device over ``workers`` devices for
  float32 leaves of ``sizes`` elements: the figures
  :func:`jaxcomp.get_stats` reads from the state after the same
  run (the same transfers, :func:`jaxcomp.optimizers.phase_transfers`)."""
  t = _transfers(tuple(sizes), workers, opt.fused)
  db = float(wire.operand_bytes(t["dense"]))
  dw = float(wire.total_ring_bytes(t["dense"])) if workers > 1 else 0.0
  cb = float(wire.operand_bytes(t["compressed"]))
  cw = float(wire.total_ring_bytes(t["compressed"]))
  dense, onebit, _ = optimizer_phases(opt)
  return OneBitTraffic.of(
      dense_steps=dense, compressed_steps=onebit, steps=opt.steps,
      skipped_steps=0,
      dense=(db, dw), compressed=(cb, cw))


def onebit_step(opt: CompressedOptimizer, sizes: Sequence[int],
                network: costs.Network, codec: CodecCost | None
                ) -> tuple[float, float]:
  """``(comm, codec)`` seconds of one 1-bit exchange on ``network``: its
  transfers, and (``codec`` given) per buffer of ``n`` elements the
  worker's encode, the server's decode of the ``p`` payloads of its chunk
  (``n`` elements in all) and re-encode of the chunk, and the decode of
  the ``p`` gathered chunks (``n`` again)."""
  p = network.workers
  ts = _transfers(tuple(sizes), p, opt.fused)["compressed"]
  comm = sum(costs.transfer_time(t, network) for t in ts)
  if codec is None:
    return comm, 0.0
  bufs = [sum(sizes)] if opt.fused else list(sizes)
  work = sum(codec.encode(n) + codec.encode(-(-n // p)) + 2 * codec.decode(n)
             for n in bufs if n)
  return comm, work

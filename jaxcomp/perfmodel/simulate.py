"""Trace-based what-if simulations: many workers, many bandwidths.

A profile's per-layer trace (sizes and backward times) is replayed through
:func:`jaxcomp.perfmodel.predict` for each worker count or link, as in
MG-WFBP's simulations from 4 to 2048 workers (Shi et al. 2019), and the
required-compression question of Zhang et al. 2020 is answered by bisection
over an ideal (linear, free) compressor.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar
from collections.abc import Mapping, Sequence

from jaxcomp.perfmodel import costs
from jaxcomp.perfmodel import model_profile as _model_profile
from jaxcomp.perfmodel import prediction as _prediction
from jaxcomp.perfmodel import pricing as _pricing

__all__ = ["DEFAULT_WORKERS", "sweep_workers", "sweep_bandwidth", "stops_paying",
           "required_ratio"]

DEFAULT_WORKERS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)

# A sweep's key: a worker count or a bandwidth.
K = TypeVar("K", bound=float)


def sweep_workers(profile: _model_profile.ModelProfile, compressors: Mapping[str, Any],
                  network: costs.Network, workers: Sequence[int] = DEFAULT_WORKERS, *,
                  codecs=None, buckets="layer", overlap: bool | str = True,
                  collective=None, sync_every: int = 1, output: str = "mean"
                  ) -> dict[int, dict[str, _prediction.Prediction]]:
  """``{p: compare(...)}`` for each worker count ``p`` (same links)."""
  out = {}
  for p in workers:
    net = network.with_workers(p)
    if net.algorithm == "hierarchical" and p % net.workers_per_node:
      raise ValueError(f"workers={p} is not a multiple of workers_per_node={net.workers_per_node}")
    out[p] = _prediction.compare(profile, compressors, net, codecs=codecs, buckets=buckets,
                            overlap=overlap, collective=collective,
                            sync_every=sync_every, output=output)
  return out


def sweep_bandwidth(profile: _model_profile.ModelProfile, compressors: Mapping[str, Any],
                    network: costs.Network, gbps: Sequence[float], *, codecs=None,
                    buckets="layer", overlap: bool | str = True, collective=None,
                    sync_every: int = 1, output: str = "mean"
                    ) -> dict[float, dict[str, _prediction.Prediction]]:
  """``{gbps: compare(...)}``, the inter-worker link set to each bandwidth."""
  out = {}
  for g in gbps:
    net = network.with_link(costs.Link.from_bandwidth(g, network.link.alpha))
    out[g] = _prediction.compare(profile, compressors, net, codecs=codecs, buckets=buckets,
                            overlap=overlap, collective=collective,
                            sync_every=sync_every, output=output)
  return out


def stops_paying(sweep: Mapping[K, Mapping[str, _prediction.Prediction]], name: str,
                 *, increasing: bool = True) -> K | None:
  """The first sweep key at which ``name``'s speedup over dense drops below 1.

  Keys are walked in increasing order (``increasing=False``: decreasing).
  Returns None if it pays everywhere in the sweep.
  """
  for k in sorted(sweep, reverse=not increasing):
    if sweep[k][name].speedup < 1.0:
      return k
  return None


def required_ratio(profile: _model_profile.ModelProfile, network: costs.Network, *,
                   target_scaling: float = 0.9, buckets="layer", overlap: bool | str = True,
                   max_ratio: float = 1e4) -> float:
  """Smallest compression ratio of an ideal compressor reaching ``target_scaling``.

  The ideal compressor is linear (all-reduce) with free encode/decode, so this
  is a lower bound for any real one. Returns 1.0 if dense already reaches the
  target and ``math.inf`` if even ``max_ratio`` does not (start-up costs).
  """
  if not 0 < target_scaling <= 1:
    raise ValueError(f"target_scaling must be in (0, 1], got {target_scaling!r}")

  def scaling(r):
    return _prediction.predict(profile, _pricing.IdealCompressor(r), network, buckets=buckets,
                          overlap=overlap).scaling_factor

  if scaling(1.0) >= target_scaling:
    return 1.0
  if scaling(max_ratio) < target_scaling:
    return math.inf
  lo, hi = 1.0, max_ratio
  for _ in range(60):
    mid = math.sqrt(lo * hi)
    if scaling(mid) >= target_scaling:
      hi = mid
    else:
      lo = mid
  return hi

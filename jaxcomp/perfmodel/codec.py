"""Micro-benchmark of a compressor's encode and decode on the local device."""

from __future__ import annotations

import inspect
import statistics
import time
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxcomp.perfmodel import model as _model

__all__ = ["measure_codec", "time_fn"]


def time_fn(fn, *args, repeats: int = 5, warmup: int = 1) -> float:
  """Median wall time of ``fn(*args)`` in seconds, outputs blocked on."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


def _fit_affine(ns: Sequence[int], ts: Sequence[float]) -> tuple[float, float]:
  """Least-squares ``t = a + b·n`` with ``a, b >= 0``."""
  k = len(ns)
  if k == 1:
    return 0.0, max(ts[0], 0.0) / max(ns[0], 1)
  mn, mt = sum(ns) / k, sum(ts) / k
  var = sum((n - mn) ** 2 for n in ns)
  b = sum((n - mn) * (t - mt) for n, t in zip(ns, ts)) / var if var else 0.0
  b = max(b, 0.0)
  a = max(mt - b * mn, 0.0)
  return a, b


def measure_codec(compressor, sizes: Sequence[int] = (1 << 14, 1 << 17, 1 << 20), *,
                  repeats: int = 5, seed: int = 0) -> _model.CodecCost:
  """Times ``compressor.encode`` / ``decode`` under ``jax.jit`` on the default device.

  Args:
    compressor: has ``encode(x, key) -> payload`` and ``decode(payload, n[, key]) -> f32[n]``.
    sizes: buffer sizes (float32 elements) to time; an affine fit in ``n``
      through them is returned.
    repeats: timed runs per size (the median is used).
    seed: PRNG seed for the test gradient and the key.

  Returns:
    A :class:`CodecCost` naming the device it was measured on.
  """
  if not sizes or any(int(n) < 1 for n in sizes):
    raise ValueError(f"sizes must be a non-empty list of positive integers, got {sizes!r}")
  key = jax.random.key(seed)
  try:
    takes_key = len(inspect.signature(compressor.decode).parameters) >= 3
  except (TypeError, ValueError):
    takes_key = False
  enc_t, dec_t = [], []
  for n in sizes:
    n = int(n)
    x = jax.random.normal(jax.random.fold_in(key, n), (n,), jnp.float32)
    enc = jax.jit(compressor.encode)
    if takes_key:
      dec = jax.jit(lambda payload, n=n: compressor.decode(payload, n, key))
    else:
      dec = jax.jit(lambda payload, n=n: compressor.decode(payload, n))
    payload = jax.block_until_ready(enc(x, key))
    enc_t.append(time_fn(enc, x, key, repeats=repeats))
    dec_t.append(time_fn(dec, payload, repeats=repeats))
  ns = [int(n) for n in sizes]
  ea, eb = _fit_affine(ns, enc_t)
  da, db = _fit_affine(ns, dec_t)
  dev = jax.devices()[0]
  return _model.CodecCost(ea, eb, da, db, device=f"{dev.platform}:{dev.device_kind}")

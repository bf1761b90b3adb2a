"""Micro-benchmark of a compressor's encode and decode on the local device."""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxcomp.perfmodel import pricing as _pricing

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


def codec_timers(compressor, sizes: Sequence[int], *, seed: int = 0):
  """Jitted, warmed-up encode and decode of ``compressor`` at each size.

  Returns ``run() -> (encode_seconds, decode_seconds)``, lists over ``sizes``
  of one timed call each, so that callers can interleave the micro-benchmark
  with other measurements (see benchmarks/validate_perfmodel.py).
  """
  if not sizes or any(int(n) < 1 for n in sizes):
    raise ValueError(f"sizes must be a non-empty list of positive integers, got {sizes!r}")
  key = jax.random.key(seed)
  try:
    takes_key = len(inspect.signature(compressor.decode).parameters) >= 3
  except (TypeError, ValueError):
    takes_key = False
  cases = []
  for n in sizes:
    n = int(n)
    x = jax.random.normal(jax.random.fold_in(key, n), (n,), jnp.float32)
    enc = jax.jit(compressor.encode)
    if takes_key:
      dec = jax.jit(lambda payload, n=n: compressor.decode(payload, n, key))
    else:
      dec = jax.jit(lambda payload, n=n: compressor.decode(payload, n))
    payload = jax.block_until_ready(enc(x, key))
    jax.block_until_ready(dec(payload))
    cases.append((enc, dec, x, payload))

  def run():
    e, d = [], []
    for enc, dec, x, payload in cases:
      e.append(time_fn(enc, x, key, repeats=1, warmup=0))
      d.append(time_fn(dec, payload, repeats=1, warmup=0))
    return e, d

  return run


def fit_codec(sizes: Sequence[int], encode_seconds: Sequence[float],
              decode_seconds: Sequence[float], device: str = "") -> _pricing.CodecCost:
  """Affine fit of measured encode/decode times over buffer sizes."""
  ns = [int(n) for n in sizes]
  ea, eb = _fit_affine(ns, list(encode_seconds))
  da, db = _fit_affine(ns, list(decode_seconds))
  return _pricing.CodecCost(ea, eb, da, db, device=device)


def device_name() -> str:
  dev = jax.devices()[0]
  return f"{dev.platform}:{dev.device_kind}"


def measure_codec(compressor, sizes: Sequence[int] = (1 << 14, 1 << 17, 1 << 20), *,
                  repeats: int = 5, seed: int = 0) -> _pricing.CodecCost:
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
  run = codec_timers(compressor, sizes, seed=seed)
  runs = [run() for _ in range(max(1, repeats))]
  enc = [statistics.median(r[0][i] for r in runs) for i in range(len(sizes))]
  dec = [statistics.median(r[1][i] for r in runs) for i in range(len(sizes))]
  return fit_codec(sizes, enc, dec, device_name())

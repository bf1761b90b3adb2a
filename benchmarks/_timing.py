"""Shared by the micro-benchmarks: one CPU thread for XLA, and the median
time of a jitted call."""

from __future__ import annotations

import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup() -> None:
  """Puts the repository on the path and keeps XLA:CPU's Eigen on one
  thread (call before importing jax)."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_cpu_multi_thread_eigen=false")
  sys.path.insert(0, REPO)


def median_ms(f, *args, reps: int) -> float:
  """Median milliseconds of ``reps`` calls of ``jax.jit(f)(*args)``, after
  one untimed call (compilation)."""
  import jax
  f = jax.jit(f)
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times)

"""Shared by the micro-benchmarks: one CPU thread for XLA, and the median
time of a jitted call."""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup() -> None:
  """Puts the repository on the path and keeps XLA:CPU's Eigen on one
  thread (call before importing jax)."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_cpu_multi_thread_eigen=false")
  sys.path.insert(0, REPO)


def median_ms(f, *args, reps: int) -> float:
  """Median milliseconds of ``reps`` calls of ``jax.jit(f)(*args)``, after
  one untimed call (compilation): :func:`jaxcomp.perfmodel.codec.time_fn`."""
  import jax

  from jaxcomp.perfmodel.codec import time_fn
  return 1e3 * time_fn(jax.jit(f), *args, repeats=reps, warmup=1)

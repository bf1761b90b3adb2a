"""Gradient-sized random numbers on the default backend: ``jax.random``
(threefry) against the counter hash of ``jaxcomp.kernels.dither``, and a
copy of the same size for scale. Medians of ``--reps`` calls::

  python benchmarks/dither_speed.py
  python benchmarks/dither_speed.py --n 25000000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--n", type=int, default=1863690)
  ap.add_argument("--reps", type=int, default=40)
  args = ap.parse_args(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_cpu_multi_thread_eigen=false")
  sys.path.insert(0, REPO)
  import jax
  import jax.numpy as jnp

  from jaxcomp.kernels import dither

  def timed(f, *a):
    f = jax.jit(f)
    jax.block_until_ready(f(*a))
    times = []
    for _ in range(args.reps):
      t0 = time.perf_counter()
      jax.block_until_ready(f(*a))
      times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)

  n, key = args.n, jax.random.key(0)
  x = jnp.ones((n,), jnp.float32)
  print(f"{jax.default_backend()}, n = {n} float32, median ms of {args.reps}")
  for name, f, a in [
      ("jax.random.uniform (threefry)", lambda k: jax.random.uniform(k, (n,)), (key,)),
      ("dither.uniform (counter hash)", lambda k: dither.uniform(k, n), (key,)),
      ("copy x * 2", lambda v: v * 2, (x,))]:
    print(f"{name:<34}{timed(f, *a):8.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Gradient-sized random numbers on the default backend: ``jax.random``
(threefry) against the counter hash of ``jaxcomp.kernels.dither``, and a
copy of the same size for scale. Medians of ``--reps`` calls::

  python benchmarks/dither_speed.py
  python benchmarks/dither_speed.py --n 25000000
"""

from __future__ import annotations

import argparse
import sys

from _timing import median_ms, setup


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--n", type=int, default=1863690)
  ap.add_argument("--reps", type=int, default=40)
  args = ap.parse_args(argv)
  setup()
  import jax
  import jax.numpy as jnp

  from jaxcomp.kernels import dither

  def timed(f, *a):
    return median_ms(f, *a, reps=args.reps)

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

"""Where the XLA top-k's time goes: each piece of
``jaxcomp.kernels.topk.topk_threshold_xla`` jitted and timed on its own.

On one CPU device, for ``--n`` float32 normal values at ``--ratio``: the
whole selection, then the sample's top-k, the mask pass over ``x``, the
compaction of the candidates, the band's compaction and sort, and the
final exact ``k``. Medians of ``--reps`` calls::

  python benchmarks/topk_breakdown.py
  python benchmarks/topk_breakdown.py --n 25000000 --ratio 0.01
"""

from __future__ import annotations

import argparse
import math
import sys

from _timing import median_ms, setup


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--n", type=int, default=1863690)
  ap.add_argument("--ratio", type=float, default=0.01)
  ap.add_argument("--reps", type=int, default=40)
  ap.add_argument("--sample-size", type=int, default=None,
                  help="the fast path's sample (default: the backend's)")
  args = ap.parse_args(argv)
  setup()
  import jax
  import jax.numpy as jnp

  from jaxcomp.kernels import compact
  from jaxcomp.kernels import _topk_select as T

  def timed(f, *a):
    return median_ms(f, *a, reps=args.reps)

  n, k = args.n, math.ceil(args.ratio * args.n)
  x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
  config = T.TopKConfig(sample_size=args.sample_size)
  s, rank, rank_hi, cap, band_cap = T.sample_plan(n, k, config)
  stride = n // s
  threshold = lambda v: T.abs_key(T.largest_abs(v[: s * stride: stride],
                                               rank))[rank - 1]
  mask = lambda v, t: T.words_xla(v, lambda key: key >= t)
  t_lo = jax.jit(threshold)(x)
  words = jax.jit(mask)(x, t_lo)
  cidx, valid = jax.jit(lambda w: compact.compact(w, cap))(words)
  ckey = jnp.where(valid, T.abs_key(x[cidx]), -1)
  t_mid = jnp.sort(ckey)[cap - k]
  print(f"{jax.default_backend()}, n = {n}, k = {k}: sample {s}, candidate "
        f"capacity {cap}, band capacity {band_cap}; median ms of {args.reps}")
  rows = [
      ("whole top-k (topk_threshold_xla)",
       lambda v: T.topk_threshold_xla(v, k, config=config), (x,)),
      ("lax.top_k of |x|", lambda v: jax.lax.top_k(jnp.abs(v), k), (x,)),
      ("sample and its top-k", threshold, (x,)),
      ("mask pass over x", mask, (x, t_lo)),
      ("compact the candidates", lambda w: compact.compact(w, cap), (words,)),
      ("band: pack and compact", lambda c: compact.compact(
          compact.pack(c, lambda v: v > 0), band_cap), (ckey,)),
      ("band: sort", lambda c: jnp.sort(c[:band_cap]), (ckey,)),
      ("final k: exact words and compact", lambda c, t: compact.compact(
          T.exact_words(compact.pack(c, lambda v: v > t),
                        compact.pack(c, lambda v: v == t), k), k),
       (ckey, t_mid)),
      ("copy x * 2 (one read and one write)", lambda v: v * 2, (x,)),
  ]
  for name, f, a in rows:
    print(f"{name:<40}{timed(f, *a):8.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

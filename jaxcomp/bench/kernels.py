"""Benchmark of the compression kernels: ``python -m jaxcomp.bench kernels``.

For each size and op it prints the median wall time over ``--repeats`` runs
(after one compile-and-run), the effective bandwidth (bytes the op must read
and write at least, divided by the time) and three ratios, all measured in the
same process on the same input:

* ``x/mem``: time over the time of one memory pass ``x * 2`` (read + write);
* ``vs top_k``: speed-up over ``lax.top_k(|x|, k)`` (top-k ops only);
* ``vs ref``: speed-up over the op's XLA reference (the ``*_reference``
  function of ``jaxcomp.kernels``).

On a GPU backend the Pallas kernels are timed too; elsewhere only the XLA
paths are (the kernels' interpret mode is a correctness tool, not a path).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp

from jaxcomp.kernels import _select
from jaxcomp.kernels import quantize
from jaxcomp.kernels import topk

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
OPS = ("topk", "sampled_topk", "sign", "qsgd", "int8")


def _size(text: str) -> int:
  return int(float(text))


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--sizes", type=_size, nargs="+", default=[25_000_000],
                      help="element counts, e.g. 1e6 2.5e7 (default 2.5e7)")
  parser.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
  parser.add_argument("--density", type=float, default=0.01,
                      help="top-k density k/n (default 0.01)")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
  parser.add_argument("--levels", type=int, default=15, help="QSGD levels")
  parser.add_argument("--bucket-size", type=int, default=512,
                      help="QSGD bucket / int8 block size")
  parser.add_argument("--implementation", choices=("auto", "xla", "pallas",
                                                    "both"), default="auto",
                      help="auto: pallas too when the backend is a GPU")


def time_fn(fn: Callable, *args, repeats: int) -> float:
  """Median seconds of ``fn(*args)`` after one warm-up (compile) call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _row(op, impl, n, seconds, nbytes, t_mem, t_topk, t_ref):
  fmt = lambda v: "-" if v is None else f"{v:.2f}"
  return (f"{op:<13} {impl:<10} {n:>11,d} {seconds * 1e3:>10.2f} "
          f"{nbytes / seconds / 1e9:>8.2f} {seconds / t_mem:>7.2f} "
          f"{fmt(None if t_topk is None else t_topk / seconds):>9} "
          f"{fmt(None if t_ref is None else t_ref / seconds):>7}")


HEADER = (f"{'op':<13} {'impl':<10} {'n':>11} {'time ms':>10} {'GB/s':>8} "
          f"{'x/mem':>7} {'vs top_k':>9} {'vs ref':>7}")


def main(args: argparse.Namespace) -> int:
  dtype = DTYPES[args.dtype]
  impls = {"auto": [_select.resolve_implementation(None)], "xla": ["xla"],
           "pallas": ["pallas"], "both": ["xla", "pallas"]}[args.implementation]
  if "pallas" in impls and "xla" not in impls:
    impls = ["xla"] + impls
  print(f"backend={jax.default_backend()} device={jax.devices()[0]} "
        f"dtype={args.dtype} density={args.density} repeats={args.repeats} "
        f"implementations={impls}")
  print(HEADER)
  itemsize = jnp.dtype(dtype).itemsize
  for n in args.sizes:
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32).astype(dtype)
    u = jax.random.uniform(jax.random.key(1), (n,), jnp.float32)
    k = max(1, int(n * args.density))
    rep = args.repeats
    t_mem = time_fn(jax.jit(lambda x: x * 2), x, repeats=rep)
    print(_row("memory x*2", "xla", n, t_mem, 2 * n * itemsize, t_mem, None,
               None))
    t_topk = None
    if {"topk", "sampled_topk"} & set(args.ops):
      t_topk = time_fn(jax.jit(lambda x: jax.lax.top_k(jnp.abs(x), k)), x,
                       repeats=rep)
      print(_row("lax.top_k", "xla", n, t_topk, n * itemsize + 8 * k, t_mem,
                 t_topk, None))
    for op in args.ops:
      if op == "topk":
        nbytes = n * itemsize + 8 * k
        t_ref = time_fn(jax.jit(lambda x: topk.topk_reference(x, k)), x,
                        repeats=rep)
        cases = {"xla": lambda x: topk.topk_threshold_xla(x, k),
                 "pallas": lambda x: topk.topk(x, k)}
      elif op == "sampled_topk":
        nbytes = n * itemsize + 8 * k
        t_ref = time_fn(jax.jit(lambda x: topk.topk_reference(x, k)), x,
                        repeats=rep)
        key = jax.random.key(2)
        cases = {impl: (lambda x, impl=impl: topk.sampled_topk(
            x, k, key, sample_ratio=0.01, implementation=impl))
                 for impl in ("xla", "pallas")}
      elif op == "sign":
        nbytes = n * itemsize + n // 8
        t_ref = time_fn(jax.jit(quantize.sign_pack_reference), x, repeats=rep)
        cases = {"xla": jax.jit(quantize.sign_pack_reference),
                 "pallas": quantize.sign_pack}
      elif op == "qsgd":
        bits = quantize.qsgd_bits(args.levels)
        nbytes = n * itemsize + 4 * n + n * bits // 8
        ref = jax.jit(lambda x: quantize.qsgd_quantize_reference(
            x, u, levels=args.levels, bucket_size=args.bucket_size))
        t_ref = time_fn(ref, x, repeats=rep)
        cases = {"xla": ref,
                 "pallas": lambda x: quantize.qsgd_quantize(
                     x, u, levels=args.levels, bucket_size=args.bucket_size)}
      else:  # int8
        nbytes = n * itemsize + n
        ref = jax.jit(lambda x: quantize.int8_block_quantize_reference(
            x, block_size=args.bucket_size))
        t_ref = time_fn(ref, x, repeats=rep)
        cases = {"xla": ref,
                 "pallas": lambda x: quantize.int8_block_quantize(
                     x, block_size=args.bucket_size)}
      if op in ("topk", "sampled_topk"):
        print(_row(f"{op}", "reference", n, t_ref, nbytes, t_mem, t_topk,
                   t_ref))
      for impl in impls:
        if op in ("sign", "qsgd", "int8") and impl == "xla":
          seconds = t_ref  # The XLA path of these ops is the reference.
        else:
          seconds = time_fn(jax.jit(cases[impl]), x, repeats=rep)
        print(_row(op, impl, n, seconds, nbytes, t_mem,
                   t_topk if op in ("topk", "sampled_topk") else None, t_ref))
  return 0


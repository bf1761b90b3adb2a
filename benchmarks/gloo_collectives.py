"""The bare collectives of JAX's gloo backend on rate-limited links.

Two JAX processes (one CPU device each), each in its own network namespace
behind a ``tc tbf`` limit (``benchmarks/netns.py``'s ``RateLimitedCluster``, needs
root), time one collective at a time on a buffer of ``--elements`` entries
(default: the parameters of ``benchmarks/vs_pytorch.py``'s MLP):

* ``psum`` in float32 and float16 (the dense and the fp16 all-reduce),
* ``psum_scatter`` in float16 (a reduce-scatter),
* ``all_gather``, ``all_to_all`` and ``ppermute`` of float16 (what jaxcomp's
  all-gather and two-phase collectives and a ring would send).

For each it prints the median time over ``--reps`` calls on process 0, the
bytes one process sends by the algorithm's count (all-reduce ``2 (p-1)/p m``,
reduce-scatter and all-to-all ``(p-1)/p m``, all-gather ``(p-1) m``,
permute ``m``, with ``m`` the operand's bytes), that divided by the time as
Gbit/s, and the time against the float32 psum of the same link. Use it to
see what a link costs per byte for each collective, e.g. that JAX's gloo sums
float16 in software (a float16 psum is slower than a float32 one on an
unlimited link) or that its point-to-point transfers use one direction at a
time::

  sudo python benchmarks/gloo_collectives.py
  sudo python benchmarks/gloo_collectives.py --links 1gbit --elements 1000000 --json /tmp/g.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns  # noqa: E402  (benchmarks/netns.py, beside this script)
NPROC = 2

# name -> (dtype, bytes sent per process as a multiple of the operand's
# bytes m at p processes)
COLLECTIVES = {
    "psum float32": ("float32", lambda p: 2 * (p - 1) / p),
    "psum float16": ("float16", lambda p: 2 * (p - 1) / p),
    "psum_scatter float16": ("float16", lambda p: (p - 1) / p),
    "all_gather float16": ("float16", lambda p: p - 1),
    "all_to_all float16": ("float16", lambda p: (p - 1) / p),
    "ppermute float16": ("float16", lambda p: 1),
}


def worker(args) -> None:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_cpu_multi_thread_eigen=false"
                             " intra_op_parallelism_threads=1")
  import jax
  import numpy as np
  from jax import lax
  from jax.sharding import PartitionSpec as P
  jax.config.update("jax_num_cpu_devices", 1)
  sys.path.insert(0, REPO)
  from jaxcomp import distributed
  distributed.initialize_from_env(args.coordinator, NPROC, args.rank,
                                  initialization_timeout=300)
  mesh = jax.make_mesh((NPROC,), ("d",))
  p = NPROC
  m = args.elements - args.elements % p  # divisible by p for the scatters
  ring = [(i, (i + 1) % p) for i in range(p)]
  ops = {
      "psum float32": lambda x: lax.psum(x, "d"),
      "psum float16": lambda x: lax.psum(x, "d"),
      "psum_scatter float16": lambda x: lax.psum_scatter(x, "d", tiled=True),
      "all_gather float16": lambda x: lax.all_gather(x, "d", tiled=True),
      "all_to_all float16": lambda x: lax.all_to_all(x, "d", 0, 0, tiled=True),
      "ppermute float16": lambda x: lax.ppermute(x, "d", ring),
  }
  out = {}
  for name, (dtype, _) in COLLECTIVES.items():
    x = distributed.global_array(np.ones((m,), dtype), mesh, P("d"),
                                 process_local=True)
    f = jax.jit(jax.shard_map(ops[name], mesh=mesh, in_specs=P("d"),
                              out_specs=P("d")))
    for _ in range(3):
      jax.block_until_ready(f(x))
    times = []
    for _ in range(args.reps):
      t0 = time.perf_counter()
      jax.block_until_ready(f(x))
      times.append(time.perf_counter() - t0)
    out[name] = {"median_s": statistics.median(times),
                 "operand_bytes": m * np.dtype(dtype).itemsize}
  if args.rank == 0:
    print("RESULT " + json.dumps({"jax": jax.__version__, "elements": m,
                                  "collectives": out}), flush=True)
  jax.distributed.shutdown()


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--links", nargs="+", default=["unlimited", "1gbit", "100mbit"])
  ap.add_argument("--elements", type=int, default=1863690)
  ap.add_argument("--reps", type=int, default=9, help="timed calls per collective")
  netns.add_cluster_flags(ap, port=13111, timeout=600.0)
  args = ap.parse_args(argv)
  if args.worker:
    worker(args)
    return 0
  if args.elements < NPROC or args.reps < 1:
    ap.error(f"--elements must be >= {NPROC} and --reps >= 1")
  results = netns.run_links(
      "gloo_collectives", args, NPROC, os.path.abspath(__file__),
      ["--elements", str(args.elements), "--reps", str(args.reps)], cwd=REPO)
  if isinstance(results, int):
    return results
  first = next(iter(results.values()))
  print(f"{NPROC} JAX {first['jax']} processes over gloo, {first['elements']} elements, "
        f"median of {args.reps} calls on process 0")
  hdr = ("link", "collective", "operand MB", "sent MB/process", "ms", "Gbit/s sent",
         "x psum float32")
  rows = []
  for link, r in results.items():
    base = r["collectives"]["psum float32"]["median_s"]
    for name, c in r["collectives"].items():
      sent = c["operand_bytes"] * COLLECTIVES[name][1](NPROC)
      rows.append((link, name, f"{c['operand_bytes'] / 1e6:.2f}", f"{sent / 1e6:.2f}",
                   f"{c['median_s'] * 1e3:.1f}", f"{8 * sent / c['median_s'] / 1e9:.3f}",
                   f"{c['median_s'] / base:.2f}"))
  return netns.report(hdr, rows, results, args.json)


if __name__ == "__main__":
  sys.exit(main())

"""FSDP and HSDP steps over real rate-limited links, side by side.

Two JAX processes (two CPU devices each: a ``("hosts", "devices")`` mesh),
each in its own network namespace behind a ``tc tbf`` limit
(``benchmarks/netns.py``, needs root), train ``benchmarks/vs_pytorch.py``'s
MLP (784-1024-1024-10, 1.86M parameters, a global batch of 64) in one run
per link with:

* dense FSDP: parameters sharded over all 4 devices, float32 gathers and a
  float32 reduce-scatter (``compressed_mean("identity", output="shard")``);
* compressed FSDP: the same with 8-bit blocks (stochastic rounding, no
  error feedback) for the gradient, and 8-bit blocks for the parameter
  gather (qwZ) with ``--qwz``;
* compressed HSDP: sharded over the two devices of a process (exact
  reduce-scatter between them), the shards averaged across the processes
  with 8-bit blocks;

and prints each one's median step time on process 0 (``--steps`` timed steps
after 2 warm-up steps) and the gradient-exchange bytes per device its
statistics report::

  sudo python benchmarks/fsdp_gloo.py --links 1gbit 100mbit
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
NPROC, DEVICES = 2, 2
RUNS = ("dense FSDP", "int8 FSDP", "int8 HSDP")


def worker(args) -> None:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_cpu_multi_thread_eigen=false")
  import jax
  import numpy as np
  import optax
  from jax.sharding import PartitionSpec as P
  jax.config.update("jax_num_cpu_devices", DEVICES)
  sys.path.insert(0, REPO)
  import jaxcomp
  from jaxcomp import distributed, fsdp
  distributed.initialize_from_env(args.coordinator, NPROC, args.rank,
                                  initialization_timeout=300)
  mesh = distributed.global_mesh()  # ("hosts", "devices")
  axes = ("hosts", "devices")
  sizes = (784, 1024, 1024, 10)
  keys = jax.random.split(jax.random.key(0), len(sizes))
  params = {f"w{i}": jax.random.normal(keys[i], (a, b)) / np.sqrt(a)
            for i, (a, b) in enumerate(zip(sizes, sizes[1:]))}

  def loss_fn(p, batch):
    x, y = batch
    for i in range(len(sizes) - 1):
      x = x @ p[f"w{i}"]
      if i < len(sizes) - 2:
        x = jax.nn.relu(x)
    return optax.softmax_cross_entropy_with_integer_labels(x, y).mean()

  rng = np.random.default_rng(args.rank)
  local = (rng.normal(size=(32, 784)).astype(np.float32),
           rng.integers(0, 10, size=(32,)).astype(np.int32))
  batch = distributed.global_array(local, mesh, P(axes), process_local=True)
  int8 = dict(rounding="stochastic")
  runs = {
      "dense FSDP": (optax.chain(jaxcomp.compressed_mean(
          "identity", axes, output="shard"), optax.sgd(0.01)), axes, None),
      "int8 FSDP": (optax.chain(jaxcomp.compressed_mean(
          "int8_block", axes, output="shard", **int8), optax.sgd(0.01)), axes,
                    "int8_block" if args.qwz else None),
      "int8 HSDP": (optax.chain(
          jaxcomp.compressed_mean("identity", "devices", output="shard"),
          jaxcomp.compressed_mean("int8_block", "hosts", **int8),
          optax.sgd(0.01)), "devices", "int8_block" if args.qwz else None),
  }
  out = {}
  for name, (tx, shard_axis, pc) in runs.items():
    shards, shapes, st, specs = fsdp.init(tx, params, mesh, axes,
                                          shard_axis=shard_axis)
    step = fsdp.make_train_step(loss_fn, tx, shapes, mesh=mesh, state_specs=specs,
                                axis_name=axes, shard_axis=shard_axis,
                                param_compressor=pc)
    for _ in range(2):
      shards, st, loss = step(shards, st, batch)
      float(loss)
    times = []
    for _ in range(args.steps):
      t0 = time.perf_counter()
      shards, st, loss = step(shards, st, batch)
      float(loss)
      times.append(time.perf_counter() - t0)
    stats = jaxcomp.get_stats(st)
    out[name] = {"median_s": statistics.median(times), "loss": float(loss),
                 "bytes_sent": float(stats.bytes_sent),
                 "wire_bytes": float(stats.wire_bytes)}
  if args.rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
  jax.distributed.shutdown()


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--links", nargs="+", default=["1gbit", "100mbit"])
  ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
  ap.add_argument("--qwz", action="store_true",
                  help="int8 blocks for the compressed runs' parameter gather")
  netns.add_cluster_flags(ap, port=13171, timeout=900.0)
  args = ap.parse_args(argv)
  if args.worker:
    worker(args)
    return 0
  results = netns.run_links(
      "fsdp_gloo", args, NPROC, os.path.abspath(__file__),
      ["--steps", str(args.steps)] + (["--qwz"] if args.qwz else []), cwd=REPO)
  if isinstance(results, int):
    return results
  print(f"{NPROC} processes x {DEVICES} CPU devices over gloo, MLP 784-1024-1024-10, "
        f"global batch 64, median of {args.steps} steps on process 0"
        + ("; compressed runs gather the parameters in int8 blocks (qwZ)" if args.qwz else ""))
  hdr = ("link", "run", "step ms", "x dense FSDP", "gradient bytes / device",
         "wire bytes / device")
  rows = []
  for link, r in results.items():
    base = r["dense FSDP"]["median_s"]
    for name in RUNS:
      c = r[name]
      rows.append((link, name, f"{c['median_s'] * 1e3:.1f}", f"{c['median_s'] / base:.2f}",
                   f"{c['bytes_sent']:,.0f}", f"{c['wire_bytes']:,.0f}"))
  return netns.report(hdr, rows, results, args.json)


if __name__ == "__main__":
  sys.exit(main())

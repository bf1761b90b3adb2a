"""What jaxcomp's transform costs a step on one device, against dense.

Times the training step of ``benchmarks/vs_pytorch.py``'s MLP
(784-1024-1024-10, its weights and batch of 64; SGD) on a one-device mesh, where XLA
drops the collectives, so what is left is the compute plus the transform:
flattening into buckets, encode/decode, error feedback and the statistics.
Prints the median step time of each compressor, its ratio to dense (the
first spec, ``identity`` by default) and the step's memory passes read from
the compiled module (:func:`jaxcomp.hlo.traffic.memory_passes`: bytes of
gradient-sized buffers read plus written on every step, over ``4 n``; the
ops inside conditional branches, fallbacks most steps skip, are shown
apart). The specs are timed
in interleaved rounds (a few steps of each in turn), so that a machine's
drift hits all of them alike; the medians are over every timed step::

  python benchmarks/transform_overhead.py
  python benchmarks/transform_overhead.py --specs identity powersgd:rank=4 --steps 50
  python benchmarks/transform_overhead.py --clock cpu   # on a shared machine
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
  ap.add_argument("--specs", nargs="+",
                  default=["identity", "powersgd:rank=4", "powersgd:rank=4,ef=off",
                           "topk:ratio=0.01", "qsgd:levels=16"],
                  help="NAME[:K=V,...]; ef=off turns error feedback off")
  ap.add_argument("--bucketing", default="whole")
  ap.add_argument("--steps", type=int, default=40, help="timed steps per spec")
  ap.add_argument("--rounds", type=int, default=8,
                  help="interleaved rounds the steps are split into")
  ap.add_argument("--show-ops", action="store_true",
                  help="print each spec's big-buffer ops (memory_passes table)")
  ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                  help="time steps by the wall clock (default) or by this "
                  "process's CPU time (steadier on a machine shared with other "
                  "jobs: waiting for a core does not count)")
  args = ap.parse_args(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_cpu_multi_thread_eigen=false")
  sys.path.insert(0, REPO)
  import jax
  import numpy as np
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  import jaxcomp
  from jaxcomp.cli import parse_compressor_spec

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from vs_pytorch import BATCH, LAYERS as layers, mlp_and_batch, mlp_loss as loss_fn
  ws, bs, xs, ys = mlp_and_batch(0)
  params = list(zip(ws, bs))

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  batch = jax.device_put((xs, ys), NamedSharding(mesh, P("data")))
  print(f"one {jax.devices()[0].platform} device, MLP {'-'.join(map(str, layers))}, "
        f"batch {BATCH}, bucketing={args.bucketing!r}, median of {args.steps} steps")
  from jaxcomp.hlo import traffic as hlo
  n = sum(int(np.prod(np.shape(w))) for layer in params for w in layer)
  steps, carries, passes = {}, {}, {}
  for spec in args.specs:
    head, _, rest = spec.partition(":")
    opts = [o for o in rest.split(",") if o and o != "ef=off"]
    name, kw = parse_compressor_spec(head + (":" + ",".join(opts) if opts else ""))
    ef = False if "ef=off" in rest.split(",") else None
    tx = optax.chain(jaxcomp.compressed_mean(name, "data", bucketing=args.bucketing,
                                             nonfinite="zero", error_feedback=ef, **kw),
                     optax.sgd(0.01))
    step = jaxcomp.make_train_step(lambda p_, b: loss_fn(p_, *b), tx, mesh=mesh,
                                   donate=False, per_device_loss=True)
    carry = [jaxcomp.init(tx, params, mesh)]
    mp = hlo.memory_passes(step.lower(carry[0], batch).compile(), n // 4)
    passes[spec] = mp
    for _ in range(3):  # untimed: compile and warm up
      carry[0], _ = jax.block_until_ready(step(carry[0], batch))
    steps[spec], carries[spec] = step, carry
  times = {spec: [] for spec in args.specs}
  clock = time.perf_counter if args.clock == "wall" else time.process_time
  per_round = -(-args.steps // args.rounds)
  for _ in range(args.rounds):
    for spec in args.specs:
      carry = carries[spec]
      for _ in range(per_round):
        t0 = clock()
        carry[0], _ = jax.block_until_ready(steps[spec](carry[0], batch))
        times[spec].append(clock() - t0)
  print(f"n = {n} gradient elements; passes: big-buffer bytes read + written / (4 n);"
        f" {args.clock} time")
  base = 1e3 * statistics.median(times[args.specs[0]])
  for spec in args.specs:
    ms = 1e3 * statistics.median(times[spec])
    mp = passes[spec]
    print(f"{spec:<28} {ms:8.2f} ms   x{ms / base:5.2f} of {args.specs[0]}"
          f"   passes {mp.passes(4 * n):5.1f} (read {mp.read_bytes / (4 * n):4.1f},"
          f" write {mp.write_bytes / (4 * n):4.1f}; in branches"
          f" {mp.branch_passes(4 * n):4.1f})")
    if args.show_ops:
      print(mp.table())
  return 0


if __name__ == "__main__":
  sys.exit(main())

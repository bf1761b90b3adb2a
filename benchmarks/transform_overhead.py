"""What jaxcomp's transform costs a step on one device, against dense.

Times the training step of ``benchmarks/vs_pytorch.py``'s MLP
(784-1024-1024-10, its weights and batch of 64; SGD) on a one-device mesh, where XLA
drops the collectives, so what is left is the compute plus the transform:
flattening into buckets, encode/decode, error feedback and the statistics.
Prints the median step time of each compressor and its ratio to dense
(``identity``)::

  python benchmarks/transform_overhead.py
  python benchmarks/transform_overhead.py --specs identity powersgd:rank=4 --steps 50
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
  ap.add_argument("--steps", type=int, default=30, help="timed steps per spec")
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
  base = None
  for spec in args.specs:
    head, _, rest = spec.partition(":")
    opts = [o for o in rest.split(",") if o and o != "ef=off"]
    name, kw = parse_compressor_spec(head + (":" + ",".join(opts) if opts else ""))
    ef = False if "ef=off" in rest.split(",") else None
    tx = optax.chain(jaxcomp.compressed_mean(name, "data", bucketing=args.bucketing,
                                             nonfinite="zero", error_feedback=ef, **kw),
                     optax.sgd(0.01))
    state, specs = jaxcomp.init_sharded(tx, params, mesh, "data")

    step = jaxcomp.make_train_step(lambda p_, b: loss_fn(p_, *b), tx, mesh=mesh,
                                   state_specs=specs, donate=False,
                                   per_device_loss=True)
    carry = [jax.device_put(params, NamedSharding(mesh, P())), state]
    times = []
    for i in range(args.steps + 3):  # 3 untimed: compile and warm up
      t0 = time.perf_counter()
      carry[0], carry[1], _ = jax.block_until_ready(step(carry[0], carry[1], batch))
      if i >= 3:
        times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(times)
    base = base or ms
    print(f"{spec:<28} {ms:8.2f} ms   x{ms / base:5.2f} of {args.specs[0]}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

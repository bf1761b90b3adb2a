"""What the bucketing costs a step: collectives, bytes and step time of the
character transformer's compressed step under ``bucketing="layerwise"``,
``"auto"`` (the default) and ``"whole"``.

The model is ``examples/char_lm``'s default (vocabulary 256, context 64,
d_model 128, 2 layers), Adam, a global batch of 32 windows, on
8 simulated CPU devices; each compressor spec is compiled once per
bucketing and its collectives read from the compiled module
(:func:`jaxcomp.collective_traffic`: count, operand bytes). Steps are timed
in interleaved rounds (a few steps of each bucketing in turn), medians over
all timed steps, the ratio against ``layerwise``::

  python benchmarks/bucket_collectives.py
  python benchmarks/bucket_collectives.py --specs topk:ratio=0.01 --steps 60
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKETINGS = ("layerwise", "auto", "whole")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--specs", nargs="+",
                  default=["topk:ratio=0.01", "int8_block:bits=4", "qsgd:levels=16"],
                  help="NAME[:K=V,...] compressor specs")
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--steps", type=int, default=40, help="timed steps per bucketing")
  ap.add_argument("--rounds", type=int, default=8)
  args = ap.parse_args(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.devices}")
  sys.path.insert(0, REPO)
  import jax
  import numpy as np
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  import jaxcomp
  from jaxcomp.cli import parse_compressor_spec
  from examples.char_lm import train as char_train
  from examples.char_lm.config import Config

  config = Config()
  model, params = char_train.init_model(config)
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  rng = np.random.default_rng(0)
  batches = [jax.device_put(
      rng.integers(0, 256, (32, config.context + 1)).astype(np.int32),
      NamedSharding(mesh, P("data"))) for _ in range(4)]

  def loss_fn(p, windows):
    logits = model.apply({"params": p}, windows[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, windows[:, 1:]).mean()

  n_leaves = len(jax.tree.leaves(params))
  print(f"char LM: {n_leaves} leaves, "
        f"{sum(x.size for x in jax.tree.leaves(params)):,} parameters, "
        f"{jax.device_count()} devices, median of {args.steps} steps")
  print(f"{'compressor':<22} {'bucketing':<10} {'buckets':>7} {'collectives':>11} "
        f"{'operand bytes':>13} {'step ms':>8} {'vs layerwise':>12}")
  for spec in args.specs:
    name, kw = parse_compressor_spec(spec)
    runs = {}
    for b in BUCKETINGS:
      tx = optax.chain(jaxcomp.compressed_mean(name, "data", bucketing=b, **kw),
                       optax.adam(1e-3))
      state = jaxcomp.init(tx, params, mesh)
      step = jaxcomp.make_train_step(loss_fn, tx, mesh=mesh, donate=False)
      ops = jaxcomp.collective_traffic(
          step.lower(state, batches[0]).compile()).ops
      buckets = len(state.opt_state[0].feedback)
      holder = [state]

      def run(t, holder=holder, step=step):
        holder[0], loss = step(holder[0], t)
        return float(loss)

      for t in batches[:2]:  # compile and warm up
        run(t)
      runs[b] = (run, buckets, len(ops), sum(o.operand_bytes for o in ops))
    times = {b: [] for b in runs}
    per = max(1, args.steps // args.rounds)
    for r in range(args.rounds):
      for b, (run, *_rest) in runs.items():
        for s in range(per):
          t0 = time.perf_counter()
          run(batches[(r + s) % len(batches)])
          times[b].append(time.perf_counter() - t0)
    med = {b: statistics.median(v) for b, v in times.items()}
    for b, (_, buckets, n_ops, nbytes) in runs.items():
      print(f"{spec:<22} {b:<10} {buckets:>7} {n_ops:>11} {nbytes:>13,.0f} "
            f"{1e3 * med[b]:>8.2f} {med[b] / med['layerwise']:>12.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

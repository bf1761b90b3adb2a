"""Sparse synchronisation of an embedding-heavy model: Zen vs all-gather of
(index, value) pairs vs dense psum.

The model is an embedding bag (a ``vocab x dim`` table, mean-pooled over
``tokens`` token ids per example) and a small linear head. Token ids are drawn
from a Zipf distribution, so the table's gradient is sparse and skewed: every
device touches the same hot rows. The head (small) goes through the exact
pmean (``min_compress_size``); the table is exchanged by

* ``psum``: the dense float32 all-reduce (``compressed_mean("identity")``);
* ``allgather``: all-gather of k (index, value) pairs per device, k the
  largest number of nonzeros a device can have (``topk`` with that ratio:
  exact, as every nonzero fits);
* ``zen``: :class:`jaxcomp.collectives.Zen`, with capacities sized from one
  profiled batch (the largest per-owner counts times ``--headroom``).

For each it prints, per device and step, the collective operand bytes and
the ring bytes (:func:`jaxcomp.collective_traffic` of the compiled step:
all-reduce 2(g-1)/g m, all-gather (g-1) m, all-to-all (g-1)/g m), the median
step time on this machine (simulated CPU devices share the host's cores: the
times show compute cost, not network time), the largest difference of the
updated table from the dense result, and the overflow left in Zen's state.

Usage:
  python benchmarks/sparse_sync.py [--devices 8] [--vocab 20000] [--dim 32]
      [--batch 64] [--tokens 8] [--zipf 1.2] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--vocab", type=int, default=20000)
  ap.add_argument("--dim", type=int, default=32)
  ap.add_argument("--batch", type=int, default=64, help="examples per device")
  ap.add_argument("--tokens", type=int, default=8, help="token ids per example")
  ap.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent (> 1)")
  ap.add_argument("--classes", type=int, default=10)
  ap.add_argument("--steps", type=int, default=5, help="timed steps")
  ap.add_argument("--headroom", type=float, default=1.25,
                  help="Zen capacities: profiled counts times this")
  args = ap.parse_args(argv)
  if args.zipf <= 1:
    ap.error(f"--zipf must be > 1, got {args.zipf}")
  os.environ.setdefault(
      "XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")

  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  import numpy as np
  import optax

  import jaxcomp
  from jaxcomp.collectives.zen import hash_index, hash_multiplier

  if jax.device_count() < args.devices:
    print(f"need {args.devices} devices, have {jax.device_count()} (set "
          "XLA_FLAGS before starting Python)", file=sys.stderr)
    return 2
  p = args.devices
  mesh = jax.make_mesh((p,), ("data",))
  rng = np.random.default_rng(0)
  V, D = args.vocab, args.dim
  n = V * D

  def batch():
    ids = np.minimum(rng.zipf(args.zipf, (p * args.batch, args.tokens)) - 1,
                     V - 1).astype(np.int32)
    labels = rng.integers(0, args.classes, (p * args.batch,)).astype(np.int32)
    return ids, labels

  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"embed": 0.1 * jax.random.normal(k1, (V, D)),
            "head": {"w": 0.1 * jax.random.normal(k2, (D, args.classes)),
                     "b": jnp.zeros((args.classes,))}}

  def loss_fn(prm, ids, labels):
    pooled = jnp.mean(prm["embed"][ids], axis=1)
    logits = pooled @ prm["head"]["w"] + prm["head"]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits,
                                                           labels).mean()

  # Profile one batch: nonzeros per device and per Zen owner partition.
  ids0, _ = batch()
  max_rows = args.batch * args.tokens
  density = min(1.0, max_rows * D / n)
  k = max(1, int(np.ceil(density * n)))
  c = -(-n // p)
  a = hash_multiplier(p * c)
  per_dev, union = [], np.zeros(n, bool)
  for d in range(p):
    rows = np.unique(ids0[d * args.batch:(d + 1) * args.batch])
    idx = (rows[:, None] * D + np.arange(D)[None, :]).reshape(-1)
    union[idx] = True
    owner = np.asarray(hash_index(jnp.asarray(idx, jnp.int32), a, p * c)) // c
    per_dev.append(np.bincount(owner, minlength=p).max())
  owner_u = np.asarray(hash_index(jnp.asarray(np.flatnonzero(union),
                                              jnp.int32), a, p * c)) // c
  per_owner = np.bincount(owner_u, minlength=p).max()
  zen = jaxcomp.collectives.Zen(
      density=density,
      capacity_factor=args.headroom * max(per_dev) * p / k,
      gather_capacity_factor=args.headroom * per_owner * p / k)
  cap, cap2 = zen.capacities(n, p)
  head_size = D * args.classes
  methods = {
      "psum": jaxcomp.compressed_mean("identity", "data"),
      "allgather": jaxcomp.compressed_mean(
          "topk", "data", ratio=density, collective="allgather",
          min_compress_size=head_size + 1, error_feedback=False),
      "zen": jaxcomp.compressed_mean("identity", "data", collective=zen,
                                     min_compress_size=head_size + 1),
  }
  print(f"embedding {V} x {D} = {n} float32 ({4 * n / 1e6:.2f} MB), "
        f"{p} devices, {args.batch} x {args.tokens} Zipf({args.zipf}) token "
        f"ids per device")
  print(f"profiled batch: <= {max_rows * D} nonzeros/device (density "
        f"{density:.4f}), {int(union.sum())} distinct nonzeros over all "
        f"devices; zen capacities: {cap} per (device, owner), {cap2} "
        f"reduced per owner")

  batches = [batch() for _ in range(args.steps + 1)]
  batches[0] = (ids0, batches[0][1])
  data_sharding = NamedSharding(mesh, P("data"))
  results = {}
  for name, ctx in methods.items():
    tx = optax.chain(ctx, optax.sgd(0.1))
    with jax.numpy_dtype_promotion("standard"):
      state = jaxcomp.init(tx, params, mesh)

      f = jaxcomp.make_train_step(lambda prm, b: loss_fn(prm, *b), tx,
                                  mesh=mesh, donate=False)
      b0 = jax.device_put(batches[0], data_sharding)
      traffic = jaxcomp.collective_traffic(f.lower(state, b0).compile())
      new, _ = f(state, b0)  # first step: compile + check
      jax.block_until_ready(new.params)
      times = []
      for b in batches[1:]:
        b = jax.device_put(b, data_sharding)
        t0 = time.perf_counter()
        out = f(state, b)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    results[name] = (traffic, statistics.median(times), new.params,
                     new.opt_state)

  dense = np.asarray(results["psum"][2]["embed"])
  print(f"\n{'method':<11}{'operand B':>12}{'ring B':>12}{'vs psum':>9}"
        f"{'step ms':>10}{'max |diff|':>12}{'overflow':>10}")
  for name, (traffic, t, prm, st) in results.items():
    diff = float(np.max(np.abs(np.asarray(prm["embed"]) - dense)))
    overflow = "-"
    if name == "zen":
      inner = st[0]
      overflow = f"{float(np.abs(np.asarray(inner.exchange_state[0])).sum()):.3g}"
    ratio = traffic.ring_bytes / results["psum"][0].ring_bytes
    print(f"{name:<11}{traffic.operand_bytes:>12}{traffic.ring_bytes:>12.0f}"
          f"{ratio:>9.3f}{1e3 * t:>10.2f}{diff:>12.2e}{overflow:>10}")
  print("\nBytes include the head's exact pmean, the loss pmean and the "
        "non-finite flag in every row.")
  return 0


if __name__ == "__main__":
  sys.exit(main())

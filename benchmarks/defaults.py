"""Every compressor at its default hyperparameters, on scikit-learn's digits.

A short check that the defaults train: an MLP (64-128-10) on the bundled
8x8 digits, 8 simulated CPU devices, Adam 3e-3, global batch 256, the same
steps and seed for every compressor. Prints the test accuracy after the
run, the operand bytes per device per step and the compression factor
against the dense float32 all-reduce, identity first.

  python benchmarks/defaults.py --steps 200
  python benchmarks/defaults.py --steps 200 --compressors qsgd:levels=4 qsgd:levels=7

A compressor spec is ``name`` or ``name:key=value,...`` (jaxcomp whatif's
syntax).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples import xla_flags  # noqa: E402  (sets XLA_FLAGS; imports no jax)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--compressors", nargs="*", default=None,
                 help="specs (default: every registered compressor)")
  args = p.parse_args(argv)
  xla_flags.set_cpu_devices(8)

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  import jaxcomp
  from examples.fashion_mnist import data as data_lib
  from jaxcomp.cli import parse_compressor_spec

  ds = data_lib.load_digits()
  x_train = ds.train_images.reshape(len(ds.train_images), -1)
  x_test = ds.test_images.reshape(len(ds.test_images), -1)
  mesh = jax.make_mesh((8,), ("data",))
  batch_sharding = NamedSharding(mesh, P("data"))

  def init(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (64, 128)) * 64 ** -0.5,
            "b1": jnp.zeros((128,)),
            "w2": jax.random.normal(k2, (128, 10)) * 128 ** -0.5,
            "b2": jnp.zeros((10,))}

  def logits(p, x):
    return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

  def loss_fn(p, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(
        logits(p, x), y).mean()

  specs = args.compressors or ["identity"] + [
      n for n in jaxcomp.compressors.names() if n != "identity"]
  rng = np.random.default_rng(args.seed)
  order = [rng.integers(0, len(x_train), 256) for _ in range(args.steps)]
  print(f"{'compressor':<28}{'test accuracy':>14}{'bytes/step':>12}"
        f"{'compression':>13}")
  for spec in specs:
    name, kwargs = parse_compressor_spec(spec)
    tx = optax.chain(jaxcomp.compressed_mean(name, "data", seed=args.seed,
                                             **kwargs), optax.adam(3e-3))
    params = init(jax.random.key(args.seed))
    state = jaxcomp.init(tx, params, mesh)
    step = jaxcomp.make_train_step(loss_fn, tx, mesh=mesh)
    for idx in order:
      batch = jax.device_put((x_train[idx], ds.train_labels[idx]),
                             batch_sharding)
      state, loss = step(state, batch)
      # Wait for each step: on a 2-core machine, XLA:CPU's 8 simulated
      # devices deadlocked in a collective with steps queued unawaited.
      loss.block_until_ready()
    acc = float(np.mean(np.argmax(np.asarray(logits(state.params, x_test)), -1)
                        == ds.test_labels))
    stats = jaxcomp.get_stats(state.opt_state)
    print(f"{spec:<28}{acc:>14.4f}{float(stats.bytes_sent):>12.0f}"
          f"{float(stats.compression_factor):>12.1f}x", flush=True)


if __name__ == "__main__":
  main()

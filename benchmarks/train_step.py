"""One compressed train step of the Fashion-MNIST CNN: kernel path vs XLA path.

Builds the CNN and train step of ``examples/fashion_mnist`` (Adam after
``jaxcomp.compressed_mean``) on every local device, and for each compressor
times the jitted step with the compressor's ``implementation="pallas"`` (the
Mosaic GPU kernels; only on an NVIDIA GPU) and ``implementation="xla"``, plus
the uncompressed ``identity`` step as the baseline, all in one process on the
same batches. Batches are real Fashion-MNIST images when the Debian package's
files are there, else random images of the same shape (the step's cost does
not depend on the pixel values).

Each trial runs ``--steps`` steps back to back and waits for the last; the
figure is the median over ``--repeats`` trials of the time per step, after
``--warmup`` steps (compilation). Ratios are to the identity step and, for
the kernel path, to the XLA path of the same compressor.

Usage:
  python benchmarks/train_step.py [--compressors topk qsgd sign int8_block]
      [--batch-size 256] [--steps 50] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples import xla_flags  # noqa: E402  (imports no jax)

# Default hyperparameters: the Fashion-MNIST example's flags.
HPARAMS = {"topk": dict(ratio=0.01), "qsgd": dict(levels=4),
           "sign": {}, "int8_block": dict(block_size=256)}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--compressors", nargs="+", default=list(HPARAMS),
                  choices=list(HPARAMS))
  ap.add_argument("--batch-size", type=int, default=256, help="global batch")
  ap.add_argument("--steps", type=int, default=50, help="steps per trial")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--devices", type=int, default=1,
                  help="simulated CPU devices (ignored on GPU)")
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  xla_flags.set_cpu_devices(args.devices)

  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  import numpy as np
  import optax

  import jaxcomp
  from examples.fashion_mnist import data as data_lib
  from examples.fashion_mnist.train import CNN
  from flax import nnx

  gpu = jaxcomp.kernels.nvidia_gpu()
  impls = ["xla", "pallas"] if gpu else ["xla"]
  n_dev = jax.device_count()
  mesh = jax.make_mesh((n_dev,), ("data",))
  bs = args.batch_size
  try:
    ds = data_lib.load("fashion_mnist")
    images, labels, source = ds.train_images, ds.train_labels, "fashion_mnist"
  except (FileNotFoundError, OSError):
    rng = np.random.default_rng(0)
    images = rng.normal(size=(8 * bs, 28, 28, 1)).astype(np.float32)
    labels = rng.integers(0, 10, size=(8 * bs,)).astype(np.int32)
    source = "random images (Fashion-MNIST files not installed)"
  graphdef, params0 = nnx.split(CNN(10, rngs=nnx.Rngs(0)))
  n_params = sum(p.size for p in jax.tree.leaves(params0))
  batch_sharding = NamedSharding(mesh, P("data"))
  batches = [jax.device_put((images[i * bs:(i + 1) * bs],
                             labels[i * bs:(i + 1) * bs]), batch_sharding)
             for i in range(min(8, len(labels) // bs))]

  def loss_fn(p, x, y):
    logits = nnx.merge(graphdef, p)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def build(name, **kw):
    tx = optax.chain(jaxcomp.compressed_mean(name, "data", **kw),
                     optax.adam(2e-3))

    # A copy: the step donates the state, whose parameters may alias
    # params0's buffers on a one-device mesh.
    state = jaxcomp.init(tx, jax.tree.map(jnp.copy, params0), mesh)
    f = jaxcomp.make_train_step(lambda p, b: loss_fn(p, *b), tx, mesh=mesh)
    return f, state

  def time_step(name, **kw):
    f, state = build(name, **kw)
    for i in range(args.warmup):
      state, loss = f(state, batches[i % len(batches)])
    jax.block_until_ready(loss)
    per_step = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      for i in range(args.steps):
        state, loss = f(state, batches[i % len(batches)])
      jax.block_until_ready((state, loss))
      per_step.append((time.perf_counter() - start) / args.steps)
    return statistics.median(per_step), float(loss)

  print(f"backend={jax.default_backend()} device={jax.devices()[0].device_kind}"
        f" devices={n_dev} jax={jax.__version__} params={n_params:,} "
        f"batch={bs} data={source} steps/trial={args.steps} "
        f"repeats={args.repeats}")
  print(f"{'compressor':<12} {'impl':<7} {'ms/step':>9} {'x identity':>10} "
        f"{'pallas/xla':>10} {'loss':>8}")
  rows = []
  base, _ = time_step("identity")
  rows.append({"compressor": "identity", "impl": "-", "seconds": base})
  print(f"{'identity':<12} {'-':<7} {base * 1e3:>9.3f} {1.0:>10.2f} "
        f"{'-':>10}")
  for name in args.compressors:
    xla_time = None
    for impl in impls:
      t, loss = time_step(name, implementation=impl, **HPARAMS[name])
      xla_time = t if impl == "xla" else xla_time
      ratio = "-" if impl == "xla" else f"{t / xla_time:.2f}"
      rows.append({"compressor": name, "impl": impl, "seconds": t,
                   "loss": loss})
      print(f"{name:<12} {impl:<7} {t * 1e3:>9.3f} {t / base:>10.2f} "
            f"{ratio:>10} {loss:>8.4f}")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "params": n_params, "batch": bs, "data": source,
                 "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""DiLoCo against data parallelism over real rate-limited links: wall time
to a validation loss.

Two (``--nproc``) JAX processes, one CPU device each, each in its own
network namespace behind a ``tc tbf`` limit (``benchmarks/netns.py``, needs
root), train the character LM (``examples/char_lm``'s model and CPython
corpus, ``--d-model`` wide, global batch 32) in one run per link with:

* dense data parallelism (Adam, a float32 all-reduce every step);
* DiLoCo, Adam per process, every ``--sync-every`` steps a pseudo-gradient
  exchange in 4-bit blocks with error feedback (outer Nesterov 0.7 / 0.9);
* the same DiLoCo, its pseudo-gradient dense.

Every ``--eval-every`` steps all processes evaluate the (synchronized)
parameters on the same held-out windows; evaluation is not timed. The
target loss is the one data parallelism reaches at ``--target-step`` (on
that link: the runs are deterministic, so every link gives the same
losses). Each run reports the training wall time until its first
evaluation at or below the target, and the *compute-only* time of those
steps: the steps times the median step of one process with no exchange at
all (a plain ``jax.jit`` step on its share of the batch). The ratio is what
the links (and the runtime's collectives) cost. DiLoCo's steps return each
process's own loss (``per_device_loss=True``), so between syncs they run no
collective::

  sudo python benchmarks/diloco_gloo.py --links 1gbit 100mbit
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

RUNS = ("data parallel, dense", "DiLoCo, int8 blocks 4-bit", "DiLoCo, dense")


def worker(args) -> None:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_cpu_multi_thread_eigen=false")
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import PartitionSpec as P
  jax.config.update("jax_num_cpu_devices", 1)
  sys.path.insert(0, REPO)
  import jaxcomp
  from jaxcomp import distributed, lowcomm
  from jaxcomp.perfmodel import codec as pm_codec
  from examples.char_lm import data as data_lib
  from examples.char_lm import model as model_lib
  distributed.initialize_from_env(args.coordinator, args.nproc, args.rank,
                                  initialization_timeout=300)
  mesh = distributed.global_mesh(("data",))
  context, batch = 64, 32
  corpus = data_lib.load(max_train_bytes=2_000_000)
  valid = distributed.global_array(
      data_lib.fixed_windows(corpus.valid, 128, context + 1), mesh, P())
  model = model_lib.CharTransformer(vocab_size=data_lib.VOCAB_SIZE, context=context,
                                    d_model=args.d_model, num_layers=2, num_heads=4)
  params = model.init(jax.random.key(0), jnp.zeros((1, context), jnp.int32))["params"]

  def loss_fn(p, windows):
    logits = model.apply({"params": p}, windows[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, windows[:, 1:]).mean()

  evaluate = jax.jit(loss_fn)
  int4 = dict(compressor="int8_block", bits=4)
  runs = {
      "data parallel, dense": None,
      "DiLoCo, int8 blocks 4-bit": int4,
      "DiLoCo, dense": dict(compressor="identity"),
  }
  out = {}
  for name, comp in runs.items():
    rng = np.random.default_rng(args.rank)

    def next_batch():
      local = data_lib.random_windows(corpus.train, batch // args.nproc,
                                      context + 1, rng)
      return distributed.global_array(local, mesh, P("data"), process_local=True)

    inner = optax.adam(3e-3)
    if comp is None:
      tx = optax.chain(jaxcomp.compressed_mean("identity", "data"), inner)

      def fresh():
        state, specs = jaxcomp.init_sharded(tx, params, mesh, "data")
        return distributed.global_array(params, mesh, P()), state, specs

      make = lambda specs: jaxcomp.make_train_step(loss_fn, tx, mesh=mesh,
                                                   state_specs=specs)
      synced = lambda p, st: p
    else:
      tx = jaxcomp.diloco(inner, sync_every=args.sync_every, **comp)
      fresh = lambda: lowcomm.init(tx, params, mesh)
      # Per-device losses: no collective at all between syncs.
      make = lambda specs: lowcomm.make_train_step(
          loss_fn, tx, mesh=mesh, state_specs=specs, per_device_loss=True)
      synced = lambda p, st: lowcomm.synced_params(st)
    # Warm-up on a throwaway copy: one whole interval, so that compiling
    # and gloo's first connections of each collective are not timed.
    p, state, specs = fresh()
    step = make(specs)
    for _ in range(args.sync_every if comp else 2):
      p, state, loss = step(p, state, next_batch())
    jax.block_until_ready(loss)
    p, state, _ = fresh()
    rng = np.random.default_rng(args.rank)  # the timed run's batches
    times, evals, elapsed = [], [], 0.0
    for i in range(1, args.steps + 1):
      b = next_batch()
      t0 = time.perf_counter()
      p, state, loss = step(p, state, b)
      jax.block_until_ready(loss)
      dt = time.perf_counter() - t0
      times.append(dt)
      elapsed += dt
      if i % args.eval_every == 0:
        evals.append((i, elapsed, float(evaluate(synced(p, state), valid))))
    out[name] = {"evals": evals, "median_step_s": statistics.median(times)}
  # This process's step with no exchange at all (one device, plain jit),
  # the same model and batch share: the compute-only step of every run.
  opt = optax.adam(3e-3)
  lp = jax.tree.map(np.asarray, params)
  ost = opt.init(lp)

  @jax.jit
  def local_step(lp, ost, w):
    loss, g = jax.value_and_grad(loss_fn)(lp, w)
    u, ost = opt.update(g, ost, lp)
    return optax.apply_updates(lp, u), ost, loss

  rng = np.random.default_rng(args.rank)
  w = data_lib.random_windows(corpus.train, batch // args.nproc, context + 1, rng)
  out["compute_step_s"] = pm_codec.time_fn(local_step, lp, ost, w, repeats=50)
  if args.rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
  jax.distributed.shutdown()


def table(results, args):
  rows = []
  for link, r in results.items():
    dp = r[RUNS[0]]
    target = next(l for i, _, l in dp["evals"] if i == args.target_step)
    for name in RUNS:
      c = r[name]
      hit = next(((i, t) for i, t, l in c["evals"] if l <= target), None)
      if hit is None:
        best = min(l for _, _, l in c["evals"])
        rows.append((link, name, f"{target:.4f}", "not reached", f"best {best:.4f}",
                     "-", "-", f"{c['median_step_s'] * 1e3:.1f}"))
        continue
      steps, wall = hit
      compute = steps * r["compute_step_s"]
      rows.append((link, name, f"{target:.4f}", str(steps), f"{wall:.1f}",
                   f"{compute:.1f}", f"{wall / compute:.2f}",
                   f"{c['median_step_s'] * 1e3:.1f}"))
  return ("link", "run", "target loss", "steps to it", "wall s", "compute-only s",
          "wall / compute", "median step ms"), rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--links", nargs="+", default=["1gbit", "100mbit"])
  ap.add_argument("--nproc", type=int, default=2)
  ap.add_argument("--steps", type=int, default=600, help="steps per run")
  ap.add_argument("--eval-every", type=int, default=50)
  ap.add_argument("--target-step", type=int, default=400,
                  help="the target is data parallelism's loss at this step")
  ap.add_argument("--sync-every", type=int, default=25, help="DiLoCo's H")
  ap.add_argument("--d-model", type=int, default=64)
  netns.add_cluster_flags(ap, port=13191, timeout=3600.0)
  args = ap.parse_args(argv)
  if args.worker:
    worker(args)
    return 0
  if args.target_step % args.eval_every or args.target_step > args.steps:
    ap.error("--target-step must be a multiple of --eval-every, at most --steps")
  results = netns.results_or_run(
      "diloco_gloo", args, args.nproc, os.path.abspath(__file__),
      ["--nproc", str(args.nproc), "--steps", str(args.steps), "--eval-every",
       str(args.eval_every), "--sync-every", str(args.sync_every), "--d-model",
       str(args.d_model)], cwd=REPO)
  if isinstance(results, int):
    return results
  print(f"{args.nproc} processes x 1 CPU device over gloo, character LM d_model "
        f"{args.d_model}, global batch 32, Adam 3e-3; DiLoCo H={args.sync_every}; "
        f"target: data parallelism's validation loss at step {args.target_step}")
  hdr, rows = table(results, args)
  return netns.report(hdr, rows, results, args.json)


if __name__ == "__main__":
  sys.exit(main())

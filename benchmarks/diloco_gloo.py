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

``--devices-per-process 2`` runs *islands*: each process has two CPU devices
(a ``("hosts", "data")`` mesh, ``distributed.global_mesh``). Data
parallelism then averages over all devices of both axes (the batch sharded
over both); DiLoCo keeps exact data parallelism inside a process (the inner
optimizer starts with ``compressed_mean("identity", "data")``) and runs its
exchange across processes (``axis_name="hosts"``, one copy per island,
``layout=jaxcomp.Islands(over="hosts")``). The compute-only step is then each process's
devices stepping at once with no collective. Beside each run the table
gives the performance model's prediction of its mean step and of its wall
time to the target (the steps times that step), made from the link's
``tc`` rate and what the same run measures (a one-device compute profile
scaled to the process's concurrent local step, the start-up cost of a
4-byte all-reduce across and inside processes, the bandwidth inside one,
the 4-bit codec; see ``_predict``)::

  sudo python benchmarks/diloco_gloo.py --devices-per-process 2 \
      --links 1gbit 100mbit --steps 400 --eval-every 25 --target-step 200 \
      --json benchmarks/results/diloco_gloo_islands.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
  dpp = args.devices_per_process
  jax.config.update("jax_num_cpu_devices", dpp)
  sys.path.insert(0, REPO)
  import jaxcomp
  from jaxcomp import distributed
  from jaxcomp.perfmodel import codec as pm_codec
  from examples.char_lm import data as data_lib
  from examples.char_lm import model as model_lib
  # A long heartbeat and no peer watcher: on a busy machine a process can
  # miss the default 10 s heartbeat, or abort in shutdown while the watcher
  # queries its peers.
  distributed.initialize_from_env(args.coordinator, args.nproc, args.rank,
                                  initialization_timeout=300,
                                  heartbeat_timeout_seconds=120, watch_peers=False)
  # One device per process: a flat "data" mesh. Islands: ("hosts", "data"),
  # row i holding process i's devices.
  axes = "data" if dpp == 1 else ("hosts", "data")
  mesh = distributed.global_mesh(("data",) if dpp == 1 else axes)
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
      return distributed.global_array(local, mesh, P(axes), process_local=True)

    inner = optax.adam(3e-3)
    if comp is None:
      tx = optax.chain(jaxcomp.compressed_mean("identity", axes), inner)
      layout = jaxcomp.DataParallel()
    elif dpp > 1:
      # Islands: exact data parallelism inside a process over "data",
      # DiLoCo's exchange across processes over "hosts".
      tx = jaxcomp.diloco(
          optax.chain(jaxcomp.compressed_mean("identity", "data"), inner),
          sync_every=args.sync_every, axis_name="hosts", **comp)
      layout = jaxcomp.Islands(over="hosts")
    else:
      tx = jaxcomp.diloco(inner, sync_every=args.sync_every, **comp)
      layout = jaxcomp.Islands()
    fresh = lambda: jaxcomp.init(tx, params, mesh, layout=layout, axis_name=axes)
    # DiLoCo's per-device losses: no collective at all between syncs.
    step = jaxcomp.make_train_step(loss_fn, tx, mesh=mesh, layout=layout,
                                   axis_name=axes, per_device_loss=comp is not None)
    # Warm-up on a throwaway copy: one whole interval, so that compiling
    # and gloo's first connections of each collective are not timed.
    state = fresh()
    for _ in range(args.sync_every if comp else 2):
      state, loss = step(state, next_batch())
    jax.block_until_ready(loss)
    state = fresh()
    rng = np.random.default_rng(args.rank)  # the timed run's batches
    times, evals, elapsed = [], [], 0.0
    for i in range(1, args.steps + 1):
      b = next_batch()
      t0 = time.perf_counter()
      state, loss = step(state, b)
      jax.block_until_ready(loss)
      dt = time.perf_counter() - t0
      times.append(dt)
      elapsed += dt
      if i % args.eval_every == 0:
        evals.append((i, elapsed, float(evaluate(state.model_params(), valid))))
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
  if dpp == 1:
    out["compute_step_s"] = pm_codec.time_fn(local_step, lp, ost, w, repeats=50)
  else:
    out["measured"] = _measure_for_model(args, loss_fn, local_step, lp, ost, w, mesh)
    out["compute_step_s"] = out["measured"]["local_step_s"]
  if args.rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
  jax.distributed.shutdown()


def _measure_for_model(args, loss_fn, local_step, lp, ost, w, mesh) -> dict:
  """Islands: what the performance model needs, measured in this run.

  * The compute-only step: each process's devices taking ``local_step``
    (Adam on a device's share of the batch) at once, with no collective,
    every process at once (they share the cores in the training runs).
  * A one-device compute profile (``profile``) of the same share, to
    be scaled to that step.
  * A 4-byte all-reduce across processes ("hosts") and inside one
    ("data"), and a 4 MiB one inside one: the links' start-up costs and
    the bandwidth inside a process (across, the ``tc`` rate is used).
  * The 4-bit codec (``measure_codec`` on one device).
  """
  import jax
  import numpy as np
  import optax
  from jax.sharding import Mesh, PartitionSpec as P
  from jaxcomp import compressors
  from jaxcomp import perfmodel as pm
  dpp = args.devices_per_process
  per_device = len(w) // dpp
  lmesh = Mesh(np.array(jax.local_devices()), ("local",))
  body = jax.jit(jax.shard_map(
      lambda p, s, x: jax.tree.map(lambda a: a[None], local_step(p, s, x)[0]),
      mesh=lmesh, in_specs=(P(), P(), P("local")), out_specs=P("local")))
  xs = jax.device_put(w[:per_device * dpp])
  local_s = netns.together("local", lambda: body(lp, ost, xs), 30)
  opt = optax.adam(3e-3)

  def adam_update(p, g):
    u, _ = opt.update(g, opt.init(p), p)
    return optax.apply_updates(p, u)

  # Four groups: nothing overlaps (serial), so only the totals matter.
  prof = pm.profile(loss_fn, lp, w[:per_device], name="char_lm", split="measure",
                    max_groups=4, update_fn=adam_update)

  links = {"hosts": {"small_s": netns.allreduce_seconds(mesh, "hosts", 1, 10),
                     "group": int(mesh.shape["hosts"])},
           "data": {"small_s": netns.allreduce_seconds(mesh, "data", 1, 10),
                    "big_s": netns.allreduce_seconds(mesh, "data", 1 << 20, 10),
                    "group": int(mesh.shape["data"])}}
  codec = pm.measure_codec(compressors.get("int8_block", bits=4))
  return {"profile": prof.to_dict(), "local_step_s": local_s, "links": links,
          "codec": codec.to_dict()}


def _gbps(link: str) -> float | None:
  """The ``tc`` rate of a link name ("100mbit", "1gbit"), Gbit/s."""
  m = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)?bit", link.lower())
  if not m:
    return None
  return float(m.group(1)) * {None: 1e-9, "k": 1e-6, "m": 1e-3, "g": 1.0}[m.group(2)]


def _predict(measured, link: str, args):
  """Islands: the performance model's mean step of each run of RUNS, seconds,
  and a note on what it was made from; None for a link without a rate.

  * The compute: the one-device profile scaled to the process's concurrent
    local step (``local_step_s``).
  * Across processes: the link's ``tc`` rate, and the start-up cost of the
    measured 4-byte all-reduce; inside a process: alpha and beta from the
    4-byte and 4 MiB all-reduces.
  * Data parallelism: a flat ring over all ``hosts x devices`` devices at the
    cross-process link (as gloo runs an all-reduce over every device: the
    ring crosses each process's link), one bucket per tensor, nothing
    overlapping (XLA:CPU runs collectives on the compute thread):
    ``jaxcomp whatif --workers 4 --buckets layer --overlap serial``.
  * DiLoCo: ``jaxcomp whatif --workers 4 --algorithm hierarchical
    --workers-per-node 2 --sharding islands --diloco-every H``
    (``pm.predict(..., output="islands", sync_every=H)``): the exact mean
    inside the island on every step over the in-process link, and every H
    steps each device's exchange of the whole pseudo-gradient across
    processes, the process's devices sharing its link, nothing overlapping.
  """
  from jaxcomp import compressors
  from jaxcomp import perfmodel as pm
  gbps = _gbps(link)
  if gbps is None:
    return None
  one = pm.ModelProfile.from_dict(measured["profile"])
  prof = one.scaled(measured["local_step_s"] / one.compute_time)
  hosts_m, data_m = measured["links"]["hosts"], measured["links"]["data"]
  g, hosts = data_m["group"], hosts_m["group"]
  inter = netns.fit_link(hosts_m, gbps=gbps)
  intra = netns.fit_link(data_m)
  identity = compressors.get("identity")
  kw = dict(buckets="layer", overlap="serial")
  dp = pm.predict(prof, identity, pm.Network(hosts * g, inter), **kw)
  islands = pm.Network(hosts * g, inter, "hierarchical", workers_per_node=g,
                       intra=intra)
  inner = (pm.predict(prof, identity, pm.Network(g, intra), **kw).step_time
           - prof.compute_time)
  codec = pm.CodecCost.from_dict(measured["codec"])
  dil = {
      "DiLoCo, int8 blocks 4-bit": pm.predict(
          prof, compressors.get("int8_block", bits=4), islands, codec=codec,
          output="islands", sync_every=args.sync_every, **kw),
      "DiLoCo, dense": pm.predict(prof, identity, islands, output="islands",
                                  sync_every=args.sync_every, **kw),
  }
  step = {RUNS[0]: dp.step_time, **{k: v.step_time for k, v in dil.items()}}
  note = (f"{link}: across processes {gbps:g} Gbit/s (the tc rate), "
          f"{inter.alpha * 1e6:.0f} us per message (measured); inside one "
          f"{intra.gbps:.3g} Gbit/s, {intra.alpha * 1e6:.0f} us (measured); "
          f"compute {prof.compute_time * 1e3:.1f} ms/step; the islands' inner "
          f"mean {inner * 1e3:.2f} ms/step")
  return step, note


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


def islands_table(results, args):
  """``--devices-per-process`` > 1: the table with the model's predictions
  beside the measured times (the mean step: training wall time over its
  steps, syncs included), and the notes on what they were made from."""
  rows, notes = [], []
  for link, r in results.items():
    dp = r[RUNS[0]]
    target = next(l for i, _, l in dp["evals"] if i == args.target_step)
    pred = _predict(r["measured"], link, args)
    if pred:
      r["predicted_step_s"], note = pred[0], pred[1]
      notes.append(note)
    for name in RUNS:
      c = r[name]
      p_step = pred[0][name] if pred else None
      hit = next(((i, t) for i, t, l in c["evals"] if l <= target), None)
      steps, wall = hit or c["evals"][-1][:2]
      mean = wall / steps
      cells = [link, name, f"{target:.4f}"]
      if hit is None:
        best = min(l for _, _, l in c["evals"])
        cells += ["not reached", f"best {best:.4f}", "-", "-", "-"]
      else:
        compute = steps * r["compute_step_s"]
        cells += [str(steps), f"{wall:.1f}",
                  f"{steps * p_step:.1f}" if pred else "-",
                  f"{compute:.1f}", f"{wall / compute:.2f}"]
      cells += [f"{mean * 1e3:.1f}", f"{p_step * 1e3:.1f}" if pred else "-",
                f"{(p_step - mean) / mean:+.0%}" if pred else "-",
                f"{c['median_step_s'] * 1e3:.1f}"]
      rows.append(tuple(cells))
  hdr = ("link", "run", "target loss", "steps to it", "wall s", "predicted wall s",
         "compute-only s", "wall / compute", "mean step ms", "predicted step ms",
         "error", "median step ms")
  return hdr, rows, notes


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
  ap.add_argument("--devices-per-process", type=int, choices=(1, 2), default=1,
                  help="CPU devices per process; 2: islands (exact data "
                  "parallelism inside a process, DiLoCo across)")
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
       str(args.d_model), "--devices-per-process", str(args.devices_per_process)],
      cwd=REPO)
  if isinstance(results, int):
    return results
  dpp = args.devices_per_process
  if dpp == 1:
    print(f"{args.nproc} processes x 1 CPU device over gloo, character LM d_model "
          f"{args.d_model}, global batch 32, Adam 3e-3; DiLoCo H={args.sync_every}; "
          f"target: data parallelism's validation loss at step {args.target_step}")
    hdr, rows = table(results, args)
    return netns.report(hdr, rows, results, args.json)
  print(f"{args.nproc} processes (islands) x {dpp} CPU devices over gloo, character "
        f"LM d_model {args.d_model}, global batch 32, Adam 3e-3; data parallelism "
        f"over all {args.nproc * dpp} devices; DiLoCo H={args.sync_every} across "
        "processes, exact data parallelism inside each; target: data parallelism's "
        f"validation loss at step {args.target_step}; predicted: jaxcomp.perfmodel "
        "(see _predict)")
  hdr, rows, notes = islands_table(results, args)
  code = netns.report(hdr, rows, results, args.json)
  for n in notes:
    print(n)
  return code


if __name__ == "__main__":
  sys.exit(main())

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
statistics report, beside the performance model's prediction
(``jaxcomp.perfmodel.predict(..., output="shard" | "hsdp")``, nothing
overlapping, as XLA:CPU runs collectives on the compute thread). The
prediction is made from what the workers measure in the same run:

* the compute: a one-device ``profile`` of the loss, scaled to the
  time of each process's local step (its devices' forward, backward and
  update with no collective, every process at once, as they share the
  cores in the training steps);
* the links: a 4-byte and a 4 MiB all-reduce across processes, and inside
  one, fitted to alpha and beta (the tc rate sets the first's bandwidth;
  the fit says what gloo gets of it);
* the int8 codec: ``measure_codec`` on one device.

``--qwz`` runs are not priced (the model has no quantized parameter
gather). ``--nproc 4`` runs four processes of two devices::

  sudo python benchmarks/fsdp_gloo.py --links 1gbit 100mbit
  sudo python benchmarks/fsdp_gloo.py --links 1gbit 100mbit --nproc 4
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
DEVICES = 2
RUNS = ("dense FSDP", "int8 FSDP", "int8 HSDP")
GLOBAL_BATCH = 64


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
  from jaxcomp import distributed
  distributed.initialize_from_env(args.coordinator, args.nproc, args.rank,
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
  rows = GLOBAL_BATCH // args.nproc
  local = (rng.normal(size=(rows, 784)).astype(np.float32),
           rng.integers(0, 10, size=(rows,)).astype(np.int32))
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
    layout = jaxcomp.FSDP(shard_axis=shard_axis, param_compressor=pc)
    state = jaxcomp.init(tx, params, mesh, layout=layout, axis_name=axes)
    step = jaxcomp.make_train_step(loss_fn, tx, mesh=mesh, layout=layout,
                                   axis_name=axes)
    for _ in range(2):
      state, loss = step(state, batch)
      float(loss)
    times = []
    for _ in range(args.steps):
      t0 = time.perf_counter()
      state, loss = step(state, batch)
      float(loss)
      times.append(time.perf_counter() - t0)
    # The step's bytes: every exchange here runs every step (HSDP's two,
    # the reduce-scatter inside a process and the mean across, added).
    each = jaxcomp.get_stats(state.opt_state, by_exchange=True).values()
    assert all(s.every == 1 for s in each)
    out[name] = {"median_s": statistics.median(times), "loss": float(loss),
                 "bytes_sent": sum(float(s.bytes_sent) for s in each),
                 "wire_bytes": sum(float(s.wire_bytes) for s in each)}
  out["measured"] = _measure_for_model(args, loss_fn, params, local, mesh)
  if args.rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
  jax.distributed.shutdown()


def _measure_for_model(args, loss_fn, params, local, mesh) -> dict:
  """What the performance model needs, measured in this run: the compute
  profile, the links and the int8 codec (see the module docstring)."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, PartitionSpec as P
  from jaxcomp import compressors
  from jaxcomp import perfmodel as pm
  per_device = len(local[1]) // DEVICES
  x1, y1 = local[0][:per_device], local[1][:per_device]
  prof = pm.profile(lambda p, x, y: loss_fn(p, (x, y)), params, x1, y1, name="mlp",
                    split="measure",
                    update_fn=lambda p, g: jax.tree.map(lambda a, b: a - 0.01 * b, p, g))
  # This process's devices, computing at once with no collective.
  lmesh = Mesh(np.array(jax.local_devices()), ("local",))

  def local_step(p, x, y):
    g = jax.grad(loss_fn)(p, (x, y))
    return jax.tree.map(lambda a, b: a - 0.01 * b, p, g)

  body = jax.jit(jax.shard_map(
      lambda p, x, y: jax.tree.map(lambda a: a[None], local_step(p, x, y)),
      mesh=lmesh, in_specs=(P(), P("local"), P("local")), out_specs=P("local")))
  xs = jax.device_put(local[0][:per_device * DEVICES])
  ys = jax.device_put(local[1][:per_device * DEVICES])
  local_s = netns.together("local", lambda: body(params, xs, ys), args.steps)

  links = {axis: {"small_s": netns.allreduce_seconds(mesh, axis, 1, 5),
                  "big_s": netns.allreduce_seconds(mesh, axis, 1 << 20, 5),
                  "group": int(mesh.shape[axis])} for axis in ("hosts", "devices")}
  codec = pm.measure_codec(compressors.get("int8_block", rounding="stochastic"))
  return {"profile": prof.to_dict(), "local_step_s": local_s, "links": links,
          "codec": codec.to_dict()}


def _predict(measured) -> dict:
  """The model's step time for each run of RUNS from one link's measurements."""
  from jaxcomp import compressors
  from jaxcomp import perfmodel as pm
  # (The runs saved before the profile's name was kept have none.)
  one = pm.ModelProfile.from_dict({"name": "mlp", **measured["profile"]})
  prof = one.scaled(measured["local_step_s"] / one.compute_time)

  inter = netns.fit_link(measured["links"]["hosts"], sharing=DEVICES)
  intra = netns.fit_link(measured["links"]["devices"])
  hosts = measured["links"]["hosts"]["group"]
  # gloo runs a reduction or gather over all devices as one flat ring,
  # which crosses each process's link once: a ring of the slow link's
  # speed. Its all-to-all is pairwise instead: all of a process's devices
  # send their chunks for the other processes, (hosts - 1) / hosts of
  # each payload, through the link at once, against the ring formula's
  # (p - 1) / p of one payload.
  p = hosts * DEVICES
  a2a = DEVICES * (hosts - 1) / hosts * p / (p - 1)
  ring = pm.Network(p, inter, per_collective={
      "all-to-all": pm.Link(inter.alpha, inter.beta * a2a)})
  # HSDP's collectives run inside a process or across, one group per device.
  net = pm.Network(hosts * DEVICES, inter, algorithm="hierarchical",
                   workers_per_node=DEVICES, intra=intra)
  codec = pm.CodecCost.from_dict(measured["codec"])
  int8 = compressors.get("int8_block", rounding="stochastic")
  kw = dict(buckets="layer", overlap="serial")
  out = {
      "dense FSDP": pm.predict(prof, compressors.get("identity"), ring, output="shard", **kw),
      "int8 FSDP": pm.predict(prof, int8, ring, output="shard", codec=codec, **kw),
      "int8 HSDP": pm.predict(prof, int8, net, output="hsdp", codec=codec, **kw),
  }
  return {"step_s": {k: v.step_time for k, v in out.items()},
          "links": {"inter_gbps": inter.gbps, "inter_alpha_us": inter.alpha * 1e6,
                    "intra_gbps": intra.gbps, "intra_alpha_us": intra.alpha * 1e6},
          "compute_s": prof.compute_time}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--links", nargs="+", default=["1gbit", "100mbit"])
  ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
  ap.add_argument("--nproc", type=int, choices=(2, 4), default=2,
                  help="processes (hosts), two CPU devices each")
  ap.add_argument("--qwz", action="store_true",
                  help="int8 blocks for the compressed runs' parameter gather")
  netns.add_cluster_flags(ap, port=13171, timeout=900.0)
  args = ap.parse_args(argv)
  if args.worker:
    worker(args)
    return 0
  results = netns.results_or_run(
      "fsdp_gloo", args, args.nproc, os.path.abspath(__file__),
      ["--steps", str(args.steps), "--nproc", str(args.nproc)]
      + (["--qwz"] if args.qwz else []), cwd=REPO)
  if isinstance(results, int):
    return results
  print(f"{args.nproc} processes x {DEVICES} CPU devices over gloo, MLP 784-1024-1024-10, "
        f"global batch {GLOBAL_BATCH}, median of {args.steps} steps on process 0"
        + ("; compressed runs gather the parameters in int8 blocks (qwZ)" if args.qwz else ""))
  hdr = ("link", "run", "step ms", "x dense FSDP", "predicted ms", "predicted x dense",
         "error", "gradient bytes / device", "wire bytes / device")
  rows, notes = [], []
  for link, r in results.items():
    base = r["dense FSDP"]["median_s"]
    pred = None if args.qwz or "measured" not in r else _predict(r["measured"])
    if pred:
      r["predicted"] = pred
      lk = pred["links"]
      notes.append(f"{link}: fitted across processes {lk['inter_gbps']:.3g} Gbit/s, "
                   f"{lk['inter_alpha_us']:.0f} us per message; inside one "
                   f"{lk['intra_gbps']:.3g} Gbit/s, {lk['intra_alpha_us']:.0f} us; "
                   f"compute {pred['compute_s'] * 1e3:.1f} ms/step")
    for name in RUNS:
      c = r[name]
      p_s = pred["step_s"][name] if pred else None
      p_base = pred["step_s"]["dense FSDP"] if pred else None
      rows.append((link, name, f"{c['median_s'] * 1e3:.1f}", f"{c['median_s'] / base:.2f}",
                   f"{p_s * 1e3:.1f}" if pred else "-",
                   f"{p_s / p_base:.2f}" if pred else "-",
                   f"{(p_s - c['median_s']) / c['median_s']:+.0%}" if pred else "-",
                   f"{c['bytes_sent']:,.0f}", f"{c['wire_bytes']:,.0f}"))
  code = netns.report(hdr, rows, results, args.json)
  for n in notes:
    print(n)
  return code


if __name__ == "__main__":
  sys.exit(main())

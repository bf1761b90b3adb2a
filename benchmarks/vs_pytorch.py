"""jaxcomp against PyTorch DDP communication hooks, side by side.

Two processes per framework, collectives over gloo on both sides, the same
MLP, the same per-process batch, the same plain SGD, the same link. A JAX job
(``jax.distributed``, one CPU device per process) and a ``torch.distributed``
gloo group run side by side (process ``i`` of each in the same network
namespace), each compiled and warmed up once; the driver then hands out
measurement rounds, JAX and PyTorch taking turns, and in each round a
framework runs the same number of steps of each of its systems:

* dense: ``compressed_mean("identity", bucketing="whole")`` (one float32
  all-reduce) and DDP with no hook (float32 all-reduce);
* fp16: ``compressed_mean("fp16", bucketing="whole")`` (psum), the same with
  ``collective="two_phase"`` (all-to-all and all-gather of the float16 bits,
  sums in float32), and DDP's ``fp16_compress_hook``;
* PowerSGD rank 4 with error feedback and warm start:
  ``compressed_mean("powersgd", rank=4, bucketing="whole")``, each weight its
  own matrix and the vectors exact (as the hook does), and DDP's
  ``powerSGD_hook`` (``start_powerSGD_iter=2``, the smallest it allows with
  error feedback; warm-up steps are not timed).

DDP runs with one gradient bucket (``bucket_cap_mb=64``; see the comment in
``_torch_systems``), jaxcomp with ``nonfinite="zero"`` (no extra all-reduce
for a non-finite check, which DDP does not make either), and neither averages
the loss across processes.

Interleaving means background load on a shared machine affects every system
alike. Step time is wall time of one training step (forward, backward,
exchange, update) on process 0, median over all timed steps. Wire bytes are
what process 0's network interface really sent per step (``/proc/net/dev``
inside its namespace: payload plus gloo, TCP and IP headers); payload bytes
are the compressors' formulas.

Links: every worker runs in its own network namespace
(``benchmarks/netns.py``'s ``RateLimitedCluster``, needs root), unlimited or limited
by ``tc tbf`` to each ``--links`` rate. Without root it falls back to
localhost, unlimited only, and reads the loopback counters.

  pip install -e ".[bench]"          # torch==2.13.0, CPU build
  python benchmarks/vs_pytorch.py    # writes docs/vs_pytorch.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

LAYERS = (784, 1024, 1024, 10)  # MLP widths
BATCH = 64  # per process
LR = 0.01
RANK = 4
# (row label, PyTorch system, jaxcomp system); the target is checked per
# compressor on the best jaxcomp row of it.
PAIRS = (("dense (float32)", "dense", "dense"), ("fp16 (psum)", "fp16", "fp16"),
         ("fp16 (jaxcomp two-phase)", "fp16", "fp16_2p"),
         (f"PowerSGD rank {RANK} + EF", "powersgd", "powersgd"))


def _tx_bytes(interface: str | None) -> int:
  """Bytes sent so far by ``interface`` (``lo`` where None), as this
  process's network namespace sees them."""
  interface = interface or "lo"
  with open("/proc/net/dev") as f:
    for line in f.readlines()[2:]:
      name, rest = line.split(":", 1)
      if name.strip() == interface:
        return int(rest.split()[8])
  raise RuntimeError(f"interface {interface!r} not in /proc/net/dev")


def payload_bytes(system: str, shapes) -> int:
  """What one process contributes to the exchange per step, by formula."""
  n = [int(math.prod(s)) for s in shapes]
  if system == "dense":
    return 4 * sum(n)
  if system == "fp16":
    return 2 * sum(n)
  total = 0
  for s, k in zip(shapes, n):  # PowerSGD: P and Q per matrix, vectors exact
    if len(s) == 2 and k >= 2.0 * (s[0] + s[1]) * RANK:
      total += 4 * (s[0] + s[1]) * RANK
    else:
      total += 4 * k
  return total


# --------------------------------------------------------------- worker ---

def mlp_loss(prm, x, y):
  """Mean softmax cross-entropy of the MLP ``prm`` (a list of ``(w, b)``,
  ReLU between layers) on a batch ``x`` (float32 ``(B, 784)``), ``y``
  (int32 ``(B,)``)."""
  import jax
  import optax
  h = x
  for i, (w, b) in enumerate(prm):
    h = h @ w + b
    if i < len(prm) - 1:
      h = jax.nn.relu(h)
  return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()


def mlp_and_batch(rank):
  """The MLP's weights (``ws``), biases (``bs``) and process ``rank``'s batch
  (``xs``, ``ys``), as NumPy arrays; the same weights on every rank."""
  import numpy as np
  rng = np.random.default_rng(0)
  ws = [(rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        for a, b in zip(LAYERS[:-1], LAYERS[1:])]
  bs = [np.zeros((b,), np.float32) for b in LAYERS[1:]]
  data_rng = np.random.default_rng(1 + rank)
  xs = data_rng.standard_normal((BATCH, LAYERS[0])).astype(np.float32)
  ys = data_rng.integers(0, LAYERS[-1], (BATCH,)).astype(np.int32)
  return ws, bs, xs, ys


def _jax_systems(args, say):
  """jaxcomp train steps (dense, fp16, PowerSGD) and a local compute step."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_cpu_multi_thread_eigen=false"
                             " intra_op_parallelism_threads=1")
  import jax
  jax.config.update("jax_num_cpu_devices", 1)
  from jaxcomp import distributed
  distributed.initialize_from_env(args.coordinator, args.nproc, args.rank,
                                  initialization_timeout=300)
  from jax.experimental import multihost_utils
  import optax
  from jax.sharding import PartitionSpec as P
  import jaxcomp
  say("jax.distributed ready")

  mesh = jax.make_mesh((jax.process_count(),), ("data",))
  ws, bs, xs, ys = mlp_and_batch(args.rank)

  def global_array(a, spec):  # replicated, or this process's rows
    return distributed.global_array(a, mesh, spec, process_local=spec != P())

  params = [(global_array(w, P()), global_array(b, P())) for w, b in zip(ws, bs)]
  batch = (global_array(xs, P("data")), global_array(ys, P("data")))
  # As DDP here: one bucket for the whole model (DDP's single bucket); for
  # PowerSGD each weight its own matrix and the vectors exact (the hook's
  # per-tensor view), all P's and vectors in one psum and all Q's in another
  # (the hook's three all-reduces, two here); no non-finite check (DDP has
  # none, and "skip" costs one more all-reduce). fp16 twice: through psum,
  # which JAX's gloo sums in float16 about 4x slower than float32, and
  # through the two-phase collective (all-to-all and all-gather of the
  # float16 bits, sums in float32), which moves the same bytes.
  transforms = {
      "dense": jaxcomp.compressed_mean("identity", "data", bucketing="whole",
                                       nonfinite="zero"),
      "fp16": jaxcomp.compressed_mean("fp16", "data", bucketing="whole",
                                      nonfinite="zero"),
      "fp16_2p": jaxcomp.compressed_mean("fp16", "data", bucketing="whole",
                                         collective="two_phase", nonfinite="zero"),
      "powersgd": jaxcomp.compressed_mean(
          "powersgd", "data", rank=RANK, bucketing="whole", nonfinite="zero"),
  }
  systems, info = {}, {"hlo_operand_bytes": {}, "payload_bytes": {}}
  for name, ctx in transforms.items():
    tx = optax.chain(ctx, optax.sgd(LR))
    with jax.numpy_dtype_promotion("standard"):
      state = jaxcomp.init(tx, params, mesh)

    # The per-process loss, not averaged (DDP does not average it either).
    step = jaxcomp.make_train_step(lambda prm, b: mlp_loss(prm, *b), tx,
                                   mesh=mesh, donate=False,
                                   per_device_loss=True)
    with jax.numpy_dtype_promotion("standard"):
      compiled = step.lower(state, batch).compile()
    info["hlo_operand_bytes"][name] = jaxcomp.collective_traffic(
        compiled).operand_bytes
    info["payload_bytes"][name] = float(
        jaxcomp.get_stats(state.opt_state).bytes_sent)
    carry = {"s": state}

    def run(step=compiled, carry=carry):
      carry["s"], loss = step(carry["s"], batch)
      jax.block_until_ready(loss)

    systems[name] = run
    say(f"jax {name} compiled")

  # One process's compute alone (no exchange), for reference.
  local = jax.local_devices()[0]
  lcarry = {"p": jax.device_put([(w, b) for w, b in zip(ws, bs)], local)}
  lbatch = jax.device_put((xs, ys), local)
  local_step = jax.jit(lambda prm, x, y: jax.tree.map(
      lambda a, g: a - LR * g, prm, jax.grad(mlp_loss)(prm, x, y)))

  def run_local():
    lcarry["p"] = jax.block_until_ready(local_step(lcarry["p"], *lbatch))

  systems["local"] = run_local
  counter = iter(range(1 << 30))
  barrier = lambda: multihost_utils.sync_global_devices(f"b{next(counter)}")
  info["version"] = jax.__version__
  return systems, barrier, info


def _torch_systems(args, say):
  """DDP (no hook, fp16 hook, PowerSGD hook) and a local compute step."""
  import torch
  import torch.distributed as dist
  from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
  from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
  torch.set_num_threads(1)
  torch.set_num_interop_threads(1)
  dist.init_process_group("gloo", init_method=f"tcp://{args.coordinator}",
                          rank=args.rank, world_size=args.nproc)
  say("torch.distributed ready")
  ws, bs, xs, ys = mlp_and_batch(args.rank)
  tx_t, ty_t = torch.from_numpy(xs), torch.from_numpy(ys.astype("int64"))

  def make_mlp():
    layers = []
    for i, (w, b) in enumerate(zip(ws, bs)):
      lin = torch.nn.Linear(w.shape[0], w.shape[1])
      with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w.T.copy()))
        lin.bias.copy_(torch.from_numpy(b))
      layers.append(lin)
      if i < len(ws) - 1:
        layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)

  def make_run(model):
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def run():
      opt.zero_grad(set_to_none=True)
      loss = torch.nn.functional.cross_entropy(model(tx_t), ty_t)
      loss.backward()
      opt.step()

    return run

  hooks = {
      "dense": None,
      "fp16": (None, default_hooks.fp16_compress_hook),
      "powersgd": (powerSGD_hook.PowerSGDState(
          process_group=None, matrix_approximation_rank=RANK,
          start_powerSGD_iter=2, min_compression_rate=2,
          use_error_feedback=True, warm_start=True),
                   powerSGD_hook.powerSGD_hook),
  }
  systems = {}
  for name, hook in hooks.items():
    # One bucket for the whole model (PyTorch's default adds a 1 MiB first
    # bucket): with two buckets the PowerSGD hook's chained gloo
    # collectives of the two buckets can run in different orders on the two
    # ranks, which here hung or failed with "Received data size doesn't
    # match expected size". One bucket also matches jaxcomp's single
    # exchange after the backward pass.
    model = torch.nn.parallel.DistributedDataParallel(
        make_mlp(), bucket_cap_mb=64)
    if hook is not None:
      model.register_comm_hook(*hook)
    systems[name] = make_run(model)
  systems["local"] = make_run(make_mlp())
  shapes = [w.shape for w in ws] + [b.shape for b in bs]
  info = {"payload_bytes": {k: payload_bytes(k, shapes) for k in hooks},
          "version": torch.__version__}
  return systems, dist.barrier, info


def worker(args) -> None:
  """One process of one framework: builds its systems, then measures one
  round whenever the driver hands it a ticket (a file ``go_F_L_R``)."""
  fw = args.framework
  say = lambda *a: print(f"[{fw} {args.rank}]", *a, flush=True)
  build = _jax_systems if fw == "jax" else _torch_systems
  systems, barrier, info = build(args, say)
  for run in systems.values():  # compile, warm up, pass start_iter
    for _ in range(args.warmup):
      run()
  say("warmed up")
  res = {"links": {}, **info}
  for li, link in enumerate(args.links):
    times = {name: [] for name in systems}
    wire = {name: 0 for name in systems}
    for r in range(args.rounds):
      while not os.path.exists(os.path.join(args.sync, f"go_{fw}_{li}_{r}")):
        time.sleep(0.05)
      barrier()
      for name, run in systems.items():
        barrier()
        b0 = _tx_bytes(args.interface)
        for _ in range(args.steps):
          t0 = time.perf_counter()
          run()
          times[name].append(time.perf_counter() - t0)
        wire[name] += _tx_bytes(args.interface) - b0
      barrier()
      if args.rank == 0:
        open(os.path.join(args.sync, f"done_{fw}_{li}_{r}"), "w").close()
    n = args.rounds * args.steps
    res["links"][link] = {
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "wire_bytes_per_step": {k: v / n for k, v in wire.items()}}
    say(f"link {link} done")
  res["steps_timed"] = args.rounds * args.steps
  if args.rank == 0:
    with open(os.path.join(args.sync, f"result_{fw}.json"), "w") as f:
      json.dump(res, f)
  barrier()


# --------------------------------------------------------------- driver ---

def _worker_argv(args, fw, rank, coordinator, interface, sync, links):
  argv = [sys.executable, os.path.abspath(__file__), "--worker",
          "--framework", fw, "--rank", str(rank), "--nproc", "2",
          "--coordinator", coordinator, "--rounds", str(args.rounds),
          "--steps", str(args.steps), "--warmup", str(args.warmup),
          "--sync", sync, "--links", *links]
  if interface is not None:
    argv += ["--interface", interface]
  return argv


def _drive(procs, links, rounds, sync, set_link, timeout):
  """Hands out the rounds: per link, JAX and PyTorch take turns (the first
  to go alternates), so both see the same link and background load."""
  deadline = time.monotonic() + timeout

  def wait_for(name):
    while not os.path.exists(os.path.join(sync, name)):
      codes = [pr.poll() for pr in procs]
      if any(c not in (None, 0) for c in codes):  # 0: a framework finished
        raise RuntimeError(f"a worker failed while waiting for {name}: {codes}")
      if time.monotonic() > deadline:
        raise TimeoutError(f"no {name} within {timeout} s")
      time.sleep(0.1)

  for li, link in enumerate(links):
    set_link(link)
    print(f"link {link}: measuring", flush=True)
    for r in range(rounds):
      for fw in (("jax", "torch") if r % 2 == 0 else ("torch", "jax")):
        open(os.path.join(sync, f"go_{fw}_{li}_{r}"), "w").close()
        wait_for(f"done_{fw}_{li}_{r}")
  for pr in procs:
    code = pr.wait(timeout=max(1.0, deadline - time.monotonic()))
    if code:
      raise RuntimeError(f"worker exited with {code}")


def run_links(args, tmp):
  sync = os.path.join(tmp, "sync")
  os.makedirs(sync)
  logdir = args.logs or tmp
  names = [(fw, i) for fw in ("jax", "torch") for i in range(2)]
  logs = {k: open(os.path.join(logdir, f"{k[0]}{k[1]}.log"), "w") for k in names}
  ports = {"jax": args.port, "torch": args.port + 1}

  def dump_logs():
    for (fw, i), lg in logs.items():
      lg.flush()
      with open(os.path.join(logdir, f"{fw}{i}.log")) as f:
        print(f"--- {fw} worker {i} ---\n" + f.read()[-3000:], file=sys.stderr)

  try:
    import netns  # benchmarks/netns.py, beside this script
    netns.check_prerequisites()
  except Exception as e:  # no root / no ip: localhost, unlimited only
    print(f"no network namespaces ({e}); localhost, unlimited link only",
          flush=True)
    links = ["unlimited (loopback: both processes' bytes)"]
    procs = [subprocess.Popen(
        _worker_argv(args, fw, i, f"127.0.0.1:{ports[fw]}", None, sync, links),
        cwd=REPO, stdout=logs[fw, i], stderr=subprocess.STDOUT)
             for fw, i in names]
    try:
      _drive(procs, links, args.rounds, sync, lambda link: None, args.timeout)
    except BaseException:
      dump_logs()
      raise
    finally:
      for pr in procs:
        if pr.poll() is None:
          pr.kill()
  else:
    links = list(args.links)
    with netns.RateLimitedCluster(2, prefix=args.netns_prefix,
                                  subnet=args.subnet) as cluster:
      address = cluster.namespaces[0].address
      procs = [cluster.popen(i, _worker_argv(
          args, fw, i, f"{address}:{ports[fw]}", cluster.namespaces[i].veth,
          sync, links), cwd=REPO, stdout=logs[fw, i], stderr=subprocess.STDOUT)
               for fw, i in names]
      try:
        _drive(procs, links, args.rounds, sync, lambda link: cluster.set_rate(
            None if link == "unlimited" else link), args.timeout)
      except BaseException:
        dump_logs()
        raise
  for lg in logs.values():
    lg.close()
  out = {"links": {}}
  for fw in ("jax", "torch"):
    with open(os.path.join(sync, f"result_{fw}.json")) as f:
      res = json.load(f)
    out[fw] = res["version"]
    out["steps_timed"] = res["steps_timed"]
    for k, v in res["payload_bytes"].items():
      out.setdefault("payload_bytes", {})[f"{fw} {k}"] = v
    if fw == "jax":
      out["hlo_operand_bytes"] = res["hlo_operand_bytes"]
    for link, r in res["links"].items():
      d = out["links"].setdefault(link, {"median_s": {}, "wire_bytes_per_step": {}})
      for k, v in r["median_s"].items():
        d["median_s"][f"{fw} {k}"] = v
      for k, v in r["wire_bytes_per_step"].items():
        d["wire_bytes_per_step"][f"{fw} {k}"] = v
  return out


def write_markdown(res, args, path, elapsed):
  mlp = "-".join(map(str, LAYERS))
  n_params = sum(a * b + b for a, b in zip(LAYERS[:-1], LAYERS[1:]))
  lines = [
      "# jaxcomp against PyTorch DDP communication hooks", "",
      "Generated by", "", "```bash",
      "python " + " ".join(["benchmarks/vs_pytorch.py"] + args.argv), "```",
      "",
      f"2 processes (one CPU device / one PyTorch rank each, one thread "
      f"each), gloo on both sides; MLP {mlp} ({n_params} parameters), batch "
      f"{BATCH} per process, SGD lr {LR}; JAX {res['jax']}, PyTorch "
      f"{res['torch']}. Two processes per framework, process i of both in "
      "the same network namespace; JAX and PyTorch take turns, per link "
      f"{args.rounds} interleaved rounds of {args.steps} steps of each "
      f"system after {args.warmup} warm-up steps each; step time is the "
      f"median on process 0 over {res['steps_timed']} steps. Wire bytes are "
      "what process 0's interface sent per step (payload, gloo and TCP/IP "
      "headers); payload is the compressor's formula (jaxcomp: its "
      "statistics). Settings matched: one gradient bucket on both sides; "
      "PowerSGD per weight matrix (vectors exact on both sides), "
      "`nonfinite=\"zero\"`; "
      "PowerSGD with error feedback and warm start on both sides; no loss "
      "averaging on either. 'compute only' is one process's forward, "
      "backward and update with no exchange. "
      "The machine is a 2-core VM "
      f"({elapsed / 60:.1f} minutes in all).", "",
      "| link | compressor | PyTorch ms/step | jaxcomp ms/step | jaxcomp / PyTorch time | PyTorch wire B/step | jaxcomp wire B/step | jaxcomp / PyTorch wire | PyTorch payload B | jaxcomp payload B |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  checks = []
  pb = res["payload_bytes"]
  for link, r in res["links"].items():
    med, wire = r["median_s"], r["wire_bytes_per_step"]
    best = {}
    for label, tkey, jkey in PAIRS:
      tt, jt = med[f"torch {tkey}"], med[f"jax {jkey}"]
      tw, jw = wire[f"torch {tkey}"], wire[f"jax {jkey}"]
      lines.append(
          f"| {link} | {label} | {1e3 * tt:.1f} | {1e3 * jt:.1f} | "
          f"{jt / tt:.2f} | {tw:.0f} | {jw:.0f} | {jw / max(tw, 1):.2f} | "
          f"{pb[f'torch {tkey}']:.0f} | {pb[f'jax {jkey}']:.0f} |")
      if tkey != "dense" and (tkey not in best or jt / tt < best[tkey][1]):
        best[tkey] = (label, jt / tt)
    checks += [(link, label, ratio) for label, ratio in best.values()]
    lines.append(
        f"| {link} | compute only (one process, no exchange) | "
        f"{1e3 * med['torch local']:.1f} | {1e3 * med['jax local']:.1f} | "
        f"{med['jax local'] / med['torch local']:.2f} | | | | | |")
  lines += ["", "Compiled jaxcomp step, collective operand bytes per process "
            "(`jaxcomp.collective_traffic`): " + ", ".join(
                f"{k}: {v}" for k, v in res["hlo_operand_bytes"].items()),
            "", "## Target: jaxcomp's step time no worse than PyTorch's with "
            "the same compressor on every link (jaxcomp's faster row of it)", ""]
  for link, label, ratio in checks:
    lines.append(f"- {link}, {label}: jaxcomp / PyTorch = {ratio:.2f} "
                 f"**{'met' if ratio <= 1.0 else 'missed'}**")
  met = all(ratio <= 1.0 for *_, ratio in checks)
  lines += ["", f"Overall: **{'met' if met else 'missed'}**.", ""]
  with open(path, "w") as f:
    f.write("\n".join(lines))


def _raise_on_signal(signum, frame):
  raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--links", nargs="+", default=["unlimited", "1gbit", "100mbit"],
                  help="'unlimited' or tc rates such as 1gbit")
  ap.add_argument("--rounds", type=int, default=8)
  ap.add_argument("--steps", type=int, default=5, help="steps per system per round")
  ap.add_argument("--warmup", type=int, default=4)
  ap.add_argument("--timeout", type=float, default=1800.0, help="seconds in all")
  ap.add_argument("--port", type=int, default=12931)
  ap.add_argument("--netns-prefix", default=None,
                  help="namespace name prefix (default: j<pid>, unique)")
  ap.add_argument("--subnet", default=None,
                  help="the namespaces' /24 (default derived from the pid)")
  ap.add_argument("--out", default=os.path.join(REPO, "docs", "vs_pytorch.md"))
  ap.add_argument("--json", help="also write the raw results here")
  ap.add_argument("--logs", help="keep the workers' logs in this folder")
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
  ap.add_argument("--nproc", type=int, help=argparse.SUPPRESS)
  ap.add_argument("--coordinator", help=argparse.SUPPRESS)
  ap.add_argument("--interface", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--sync", help=argparse.SUPPRESS)
  ap.add_argument("--framework", choices=["jax", "torch"], help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    worker(args)
    return 0
  args.argv = argv
  if args.logs:
    os.makedirs(args.logs, exist_ok=True)
  # SIGTERM/SIGINT become exceptions, so the namespaces are always removed.
  signal.signal(signal.SIGTERM, _raise_on_signal)
  signal.signal(signal.SIGINT, _raise_on_signal)
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    results = run_links(args, tmp)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  write_markdown(results, args, args.out, time.perf_counter() - t0)
  print(open(args.out).read())
  return 0


if __name__ == "__main__":
  sys.exit(main())

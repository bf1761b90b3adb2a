"""A small MLP trained data-parallel with jaxcomp, single- or multi-process.

Two processes with two simulated CPU devices each, top-k + error feedback,
checkpoint every 5 steps:

  jaxcomp launch -n 2 --devices-per-process 2 -- \\
      python examples/multihost/train_mlp.py --steps 20 \\
      --checkpoint-dir /tmp/ckpt --save-every 5 --output /tmp/out

Restart with ``--resume`` to continue from the newest checkpoint. Run it
without the launcher for a single process (``XLA_FLAGS=
--xla_force_host_platform_device_count=4 python examples/...``), or on a
cluster with ``--coordinator-address/--num-processes/--process-id`` or under
SLURM (auto-detected).

The data is synthetic and a pure function of (seed, step): every process
builds the same global batch and keeps its devices' rows, so a run gives the
same result whether it was interrupted or not, and on any process count.
Each process writes ``<output>/params.p<i>.npz`` and prints a digest of the
final parameters.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import signal
import sys
import time


def parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  g = p.add_argument_group("job (default: JAXCOMP_* variables, then SLURM & co)")
  g.add_argument("--coordinator-address", default=None)
  g.add_argument("--num-processes", type=int, default=None)
  g.add_argument("--process-id", type=int, default=None)
  g.add_argument("--heartbeat-timeout", type=int, default=None,
                 help="seconds before a silent process is declared dead")
  g = p.add_argument_group("training")
  g.add_argument("--steps", type=int, default=20, help="train up to this step")
  g.add_argument("--batch-size", type=int, default=32, help="global batch")
  g.add_argument("--compressor", default="topk")
  g.add_argument("--ratio", type=float, default=0.1)
  g.add_argument("--levels", type=int, default=4)
  g.add_argument("--rank", type=int, default=1, help="PowerSGD rank")
  g.add_argument("--error-feedback", choices=["auto", "on", "off"],
                 default="auto")
  g.add_argument("--collective", default=None,
                 help="e.g. 'hierarchical': exact mean over 'devices' (inside "
                 "a host), compressed over 'hosts' (default: the "
                 "compressor's own)")
  g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
  g.add_argument("--learning-rate", type=float, default=1e-2)
  g.add_argument("--hidden", type=int, default=32)
  g.add_argument("--seed", type=int, default=0)
  g = p.add_argument_group("checkpoints and checks")
  g.add_argument("--checkpoint-dir", default=None)
  g.add_argument("--save-every", type=int, default=0)
  g.add_argument("--max-to-keep", type=int, default=None)
  g.add_argument("--resume", action="store_true",
                 help="continue from the newest checkpoint, if any")
  g.add_argument("--check-every", type=int, default=0,
                 help="check cross-process consistency every K steps")
  g.add_argument("--output", default=None, help="folder for params.p<i>.npz")
  g = p.add_argument_group("fault injection (tests)")
  g.add_argument("--crash-at-step", type=int, default=None,
                 help="SIGKILL itself before this step")
  g.add_argument("--step-delay", type=float, default=0.0,
                 help="seconds to sleep per step (to send signals mid-run)")
  g.add_argument("--crash-process", default="all",
                 help="which process crashes: an index or 'all'")
  return p.parse_args(argv)


IN, OUT = 16, 4


def init_params(seed: int, hidden: int):
  import numpy as np
  rng = np.random.default_rng(seed)
  return {
      "w1": (rng.standard_normal((IN, hidden)) / np.sqrt(IN)).astype(np.float32),
      "b1": np.zeros((hidden,), np.float32),
      "w2": (rng.standard_normal((hidden, OUT)) / np.sqrt(hidden)).astype(
          np.float32),
      "b2": np.zeros((OUT,), np.float32),
  }


def batch_at(seed: int, step: int, size: int):
  """The global batch of ``step``: a pure function of (seed, step)."""
  import numpy as np
  teacher = np.random.default_rng(seed + 1).standard_normal((IN, OUT))
  rng = np.random.default_rng([seed, step])
  x = rng.standard_normal((size, IN)).astype(np.float32)
  return x, np.argmax(x @ teacher, axis=-1).astype(np.int32)


def compression_config(args) -> dict:
  import jaxcomp
  fields = jaxcomp.compressors.hyperparameters(args.compressor)
  hyper = {k: v for k, v in {"ratio": args.ratio, "levels": args.levels,
                              "rank": args.rank}.items() if k in fields}
  return {"compressor": args.compressor, **hyper,
          "error_feedback": args.error_feedback, "bucketing": "layerwise",
          "collective": args.collective, "axis_name": ["hosts", "devices"],
          "seed": args.seed}


def digest(params) -> str:
  import numpy as np
  h = hashlib.sha256()
  for k in sorted(params):
    h.update(k.encode())
    h.update(np.ascontiguousarray(params[k]).tobytes())
  return h.hexdigest()[:16]


def main(argv=None) -> int:
  args = parse(argv)
  from jaxcomp import checkpoint, distributed
  distributed.initialize_from_env(
      args.coordinator_address, args.num_processes, args.process_id,
      heartbeat_timeout_seconds=args.heartbeat_timeout)

  import jax
  from jax.sharding import PartitionSpec as P
  import numpy as np
  import optax
  import jaxcomp

  pid, nproc = jax.process_index(), jax.process_count()
  mesh = distributed.global_mesh(("hosts", "devices"))
  axes = ("hosts", "devices")
  n_dev = mesh.devices.size
  if args.batch_size % n_dev:
    raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of "
                     f"the device count {n_dev}")
  print(f"process {pid}/{nproc}: mesh {dict(mesh.shape)}, "
        f"{jax.local_device_count()} local devices", flush=True)

  def loss_fn(p, x, y):
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    logits = h @ p["w2"] + p["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  config = compression_config(args)
  ef = {"auto": None, "on": True, "off": False}[args.error_feedback]
  hyper = {k: v for k, v in config.items() if k in ("ratio", "levels", "rank")}
  inner = (optax.adam(args.learning_rate) if args.optimizer == "adam" else
           optax.sgd(args.learning_rate))
  tx = optax.chain(
      jaxcomp.compressed_mean(args.compressor, axes, error_feedback=ef,
                              collective=args.collective, seed=args.seed,
                              **hyper),
      inner)

  params = distributed.global_array(init_params(args.seed, args.hidden), mesh)
  state = jaxcomp.init(tx, params, mesh, axis_name=axes)
  step = jaxcomp.make_train_step(lambda p, b: loss_fn(p, *b), tx, mesh=mesh,
                                 axis_name=axes)

  ckpt = None
  start = 0
  if args.checkpoint_dir:
    # The transform records its own configuration in the checkpoint.
    ckpt = checkpoint.Checkpointer(args.checkpoint_dir,
                                   max_to_keep=args.max_to_keep)
    if args.resume and ckpt.latest_step() is not None:
      start, saved = ckpt.restore({"params": state.params,
                                   "opt_state": state.opt_state})
      if start > args.steps:
        print(f"process {pid}: the checkpoint in {ckpt.directory} is at step "
              f"{start}, past --steps {args.steps}: it would report step "
              f"{args.steps} while holding step {start}'s parameters; pass "
              f"--steps {start} or more", file=sys.stderr, flush=True)
        return 2
      state = dataclasses.replace(state, **saved)
      print(f"resumed from step {start} of {ckpt.directory}", flush=True)
    elif args.resume:
      print(f"no checkpoint in {ckpt.directory}; starting at step 0",
            flush=True)

  crashers = (range(nproc) if args.crash_process == "all" else
              [int(args.crash_process)])
  loss = None
  t0 = time.perf_counter()
  for t in range(start, args.steps):
    if distributed.preemption_requested(t):
      # Preempted (SIGTERM to a process or to the launcher): every process
      # stops at this same step, saves and exits 0.
      if ckpt is not None and t not in ckpt.all_steps():
        ckpt.save(t, {"params": state.params, "opt_state": state.opt_state})
      print(f"process {pid}: preempted before step {t}; "
            + ("saved a checkpoint, " if ckpt is not None else "")
            + "exiting", flush=True)
      return 0
    if args.crash_at_step == t and pid in crashers:
      print(f"process {pid}: crashing (SIGKILL) before step {t}", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    batch = distributed.global_array(batch_at(args.seed, t, args.batch_size),
                                     mesh, P(axes))
    state, loss = step(state, batch)
    if args.step_delay:
      time.sleep(args.step_delay)
    done = t + 1
    if args.check_every and done % args.check_every == 0:
      n = distributed.check_consistency(
          {"params": state.params, "opt_state": state.opt_state})
      print(f"step {done}: consistency check passed ({n} leaves)", flush=True)
    if ckpt is not None and args.save_every and done % args.save_every == 0:
      ckpt.save(done, {"params": state.params, "opt_state": state.opt_state})
      print(f"step {done}: saved checkpoint", flush=True)
  seconds = time.perf_counter() - t0

  host = {k: np.asarray(v.addressable_shards[0].data)
          for k, v in state.params.items()}
  if args.output:
    os.makedirs(args.output, exist_ok=True)
    np.savez(os.path.join(args.output, f"params.p{pid}.npz"), **host)
  loss_txt = f"{float(loss):.6f}" if loss is not None else "n/a"
  print(f"process {pid}: done step {args.steps} loss {loss_txt} params "
        f"{digest(host)} ({seconds:.1f} s)", flush=True)
  if ckpt is not None:
    ckpt.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Validates jaxcomp.perfmodel against real multi-process training steps.

Runs 2 to 4 JAX processes (one CPU device each, collectives over gloo), each
in its own network namespace on a bridge, every link limited by ``tc tbf``
(100 Mbit, 1 Gbit, 10 Gbit, unlimited; no netem, so no added latency).
For each link and worker count the processes measure, in interleaved rounds
of bursts of steady-state calls:

1. the link: the one-worker compute followed by a psum / all_gather of K
   float32 arrays (4 KiB .. 2 MiB; K = 1 and 8) in one program on the global
   mesh; the start-up cost per message is their difference between K = 8
   and K = 1, per collective kind, at the link's rate (``fit_startup``,
   the default ``--fit startup``), or alpha, beta and a per-step
   synchronisation cost are fitted (``fit_alpha_beta``, ``--fit per-kind``);
2. the one-worker step, the per-tensor backward times
   (jaxcomp.perfmodel.profile) and each compressor's encode/decode
   (measure_codec);
3. each compressor's training step on a one-device mesh (no network);
   where workers outnumber cores, this and the one-worker step of (2) are
   timed after a barrier, so that all workers compute together and the
   first to finish wait idle, as in a synchronous step;
4. real data-parallel training steps of the model (``--model``: an MLP,
   the Fashion-MNIST CNN of ``examples/fashion_mnist`` on Fashion-MNIST
   images, or the character LM of ``examples/char_lm`` on its corpus) with
   ``jaxcomp.compressed_mean`` for dense (identity) and the compressors.

The per-tensor split of (2) is the :class:`jaxcomp.perfmodel.ModelProfile`
that ``jaxcomp.perfmodel.profile`` measures of that model; each round also
records ``os.getloadavg()``, since other work on the machine moves every
figure.

The orchestrator then predicts every training run of (4) from (1) to (3)
and the compiled step's collective messages (``--compute local`` takes (3)
as the compute; ``--compute single`` the one-worker step plus encode/decode)
and prints measured next to predicted with the relative error.

Usage (root, iproute2 with tc):
  python benchmarks/validate_perfmodel.py --out docs/perfmodel_validation
  python benchmarks/validate_perfmodel.py --model cnn --workers 2 \
      --rates 100mbit 1gbit --compressors identity int8_block \
      topk:ratio=0.01 powersgd:rank=2 --compute local --out /tmp/val_cnn
  python benchmarks/validate_perfmodel.py --model char_lm --workers 2 \
      --rates 100mbit --compressors adam onebit_adam --compute local --pin \
      --out /tmp/val_onebit   # dense Adam against 1-bit Adam after its freeze
Writes OUT.txt (the printed report), OUT.json (all measurements) and
OUT.png (measured and predicted speedup over dense against bandwidth).

Refuses to run (exit 2, with a message) without root or tc. Namespaces and
worker processes are removed even when a run fails or on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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

RATES = ("100mbit", "1gbit", "10gbit", "unlimited")
COMPRESSORS = ("identity", "bf16", "topk:ratio=0.01", "random_block:ratio=0.01",
               "qsgd:levels=16")
LAYERS = (512, 1024, 512, 256, 10)  # MLP widths: input 512 ... 10 classes
BATCH = 64  # per worker
MODELS = ("mlp", "cnn", "char_lm")
# Specs that name an optimizer instead of a compressor: dense Adam (a float32
# all-reduce of the gradient, then optax.adam) and DeepSpeed's compressed
# optimizers that own their exchange, timed after their freeze
# (freeze_step=1: every timed step makes one 1-bit exchange). Give "adam"
# first to measure the others' speedup against it.
OWN_EXCHANGE = ("onebit_adam", "onebit_lamb")  # priced as CompressedOptimizer
OPTIMIZER_SPECS = ("adam",) + OWN_EXCHANGE
# Small: with freeze_step=1 the frozen variance holds one step's (1 - b2)
# g^2, so each 1-bit step moves a parameter by about 3 learning rates, and
# 1-bit Adam at 1e-3 (and 1e-4) reached NaN in about 20 steps on the char LM;
# its default nonfinite="skip" then skips the exchange, and the step timed
# is not a 1-bit step. The timing does not depend on the values; the worker
# records each step's last loss and the report refuses a non-finite one.
OPTIMIZER_LR = 1e-5
# Per-worker batches of the examples' models, small enough that a step on
# one CPU core takes tens of milliseconds (rows of images; windows of tokens).
MODEL_BATCH = {"mlp": BATCH, "cnn": 32, "char_lm": 8}
# (float32 elements per array, arrays per collective): 4 KiB .. 2 MiB messages,
# the small ones also as 8 operands of one collective.
COLL_CASES = ((1 << 10, 1), (1 << 10, 8), (1 << 14, 1), (1 << 14, 8), (1 << 17, 1), (1 << 19, 1))


def model_case(name: str, batch: int | None = None, seed: int = 0):
  """``(params, loss_fn, x, y, label)`` of model ``name`` (:data:`MODELS`).

  ``params`` is a pytree of float32 numpy arrays, ``loss_fn(params, x, y)``
  a scalar loss, ``(x, y)`` one worker's batch of ``batch`` rows (default
  :data:`MODEL_BATCH`): MLP on Gaussian inputs; the Fashion-MNIST CNN
  (Flax NNX, ``examples/fashion_mnist``) on the first training images of
  Fashion-MNIST (scikit-learn's digits where it is not installed); the
  character LM (Flax linen, ``examples/char_lm``, its default size) on
  windows of 64 bytes of its corpus.

  Raises:
    ValueError: an unknown ``name``.
  """
  import numpy as np
  import optax
  batch = batch or MODEL_BATCH.get(name, BATCH)
  rng = np.random.default_rng(seed)
  if name == "mlp":
    params = {}
    for i, (a, b) in enumerate(zip(LAYERS[:-1], LAYERS[1:])):
      params[f"layer{i}"] = {"w": (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
                             "b": np.zeros((b,), np.float32)}

    def loss_fn(prm, x, y):
      import jax
      h = x
      for i in range(len(LAYERS) - 1):
        h = h @ prm[f"layer{i}"]["w"] + prm[f"layer{i}"]["b"]
        if i < len(LAYERS) - 2:
          h = jax.nn.relu(h)
      return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

    xs = rng.standard_normal((batch, LAYERS[0])).astype(np.float32)
    ys = rng.integers(0, LAYERS[-1], (batch,)).astype(np.int32)
    return params, loss_fn, xs, ys, f"MLP {'-'.join(map(str, LAYERS))}"
  if REPO not in sys.path:
    sys.path.insert(0, REPO)
  import jax
  if name == "cnn":
    from flax import nnx
    from examples.fashion_mnist import data as fashion_data
    from examples.fashion_mnist.train import CNN
    ds = fashion_data.load("auto")
    model = CNN(ds.num_classes, image_shape=ds.train_images.shape[1:], rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model, nnx.Param)
    params = jax.tree.map(lambda a: np.asarray(a, np.float32), nnx.as_pure(state))

    def loss_fn(prm, x, y):
      return optax.softmax_cross_entropy_with_integer_labels(
          nnx.merge(graphdef, prm)(x), y).mean()

    return (params, loss_fn, ds.train_images[:batch], ds.train_labels[:batch],
            f"{ds.name} CNN")
  if name == "char_lm":
    from examples.char_lm import data as lm_data
    from examples.char_lm.model import CharTransformer
    model = CharTransformer()
    text = lm_data.load(max_train_bytes=200_000, max_valid_bytes=1).train
    win = lm_data.random_windows(text, batch, model.context + 1, rng).astype(np.int32)
    xs, ys = win[:, :-1], win[:, 1:]
    params = jax.tree.map(lambda a: np.asarray(a, np.float32),
                          model.init(jax.random.key(seed), xs)["params"])

    def loss_fn(prm, x, y):
      return optax.softmax_cross_entropy_with_integer_labels(
          model.apply({"params": prm}, x), y).mean()

    return params, loss_fn, xs, ys, "char LM"
  raise ValueError(f"model must be one of {MODELS}, got {name!r}")


# --------------------------------------------------------------- worker ---

def worker(args) -> None:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_cpu_multi_thread_eigen=false"
                             )
  import jax
  from jaxcomp import distributed
  distributed.initialize_from_env(args.coordinator, args.nproc, args.rank,
                                  initialization_timeout=120)
  import numpy as np
  import optax
  from jax import lax
  from jax.sharding import NamedSharding, PartitionSpec as P

  import jaxcomp
  from jaxcomp import perfmodel as pm
  from jaxcomp.cli import parse_compressor_spec
  from jaxcomp.perfmodel.codec import codec_timers, device_name, fit_codec, time_fn

  p = jax.process_count()
  mesh = jax.make_mesh((p,), ("data",))
  out = {"nproc": p, "rank": jax.process_index()}

  def global_array(tree, spec):  # replicated, or this process's rows
    return distributed.global_array(tree, mesh, spec,
                                    process_local=spec != P())

  # The model (--model), one worker's batch, softmax cross-entropy.
  params, loss_fn, xs, ys, label = model_case(args.model)
  out["model"], out["batch_per_worker"] = label, int(xs.shape[0])
  out["loadavg_start"] = os.getloadavg()
  lr = 0.01
  timed = {}  # name -> callable timing one call, run once per round

  # 2. One worker's compute (gradient + SGD update, no exchange), the
  #    per-tensor split of the backward pass (profile), and each
  #    compressor's encode/decode at the model's tensor sizes. Each process
  #    measures while the others do the same, sharing the CPU as in training.
  local = jax.local_devices()[0]
  lp = jax.device_put(params, local)
  lx, ly = jax.device_put((xs, ys), local)
  sgd = lambda prm, g: jax.tree.map(lambda a, b: a - lr * b, prm, g)
  prof = pm.profile(loss_fn, lp, lx, ly, name=args.model, split="measure",
                    max_groups=min(16, len(jax.tree.leaves(params))), repeats=3,
                    update_fn=sgd)
  out["profile"] = prof.to_dict()
  one_step = jax.jit(lambda prm, x, y: sgd(prm, jax.grad(loss_fn)(prm, x, y)))
  time_fn(one_step, lp, lx, ly, repeats=1, warmup=2)

  # The compute phase of a synchronous step: every worker starts together
  # (the previous step's collective released them) and those that finish
  # first wait, idle, in the next collective, leaving the CPU to the others.
  # Where workers outnumber cores (4 processes on 2 here) that phase is
  # shorter than the slowest worker's time under back-to-back calls, which
  # keep every core busy. So there each timed local call starts after a
  # barrier (a scalar psum on the global mesh) and only the call is timed.
  # With a core per worker nothing waits for a core, and the barrier's own
  # gloo wake-up then lengthens the timed call (by about 1.5 ms at 2
  # workers here, as much as a small collective costs), so "auto" uses the
  # barrier only where workers outnumber cores.
  after_barrier = (args.compute_after_barrier == "on" or (
      args.compute_after_barrier == "auto" and p > (os.cpu_count() or 1)))
  out["compute_after_barrier"] = after_barrier
  if after_barrier:
    barrier_fn = jax.jit(jax.shard_map(lambda a: lax.psum(a, "data"), mesh=mesh,
                                       in_specs=P("data"), out_specs=P(), check_vma=False))
    barrier_x = global_array(np.ones((p,), np.float32), P("data"))
    jax.block_until_ready(barrier_fn(barrier_x))

  def burst_timer(call, barrier):
    """Runs ``call`` (after a barrier, if ``barrier``) burst + 1 times;
    median of the last ``burst`` (the first one absorbs the workers' skew)."""
    def one():
      ts = []
      for _ in range(args.burst + 1):
        if barrier:
          jax.block_until_ready(barrier_fn(barrier_x))
        t0 = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t0)
      return statistics.median(ts[1:])
    return one

  timed["single_worker_step"] = burst_timer(
      lambda: jax.block_until_ready(one_step(lp, lx, ly)), after_barrier)

  # 1. Collectives on this link, as a training step issues them: the
  #    one-worker compute above, then one psum (all_gather) over K arrays of
  #    n floats that depend on it, on the global mesh. XLA's combiner makes
  #    that one tuple-shaped op and XLA:CPU runs one gloo collective per
  #    operand, as for a step's per-tensor buckets. Less the one-worker step
  #    of the same round, the time is t = c0 + K·(message), from which
  #    alpha, beta and c0 (the workers waiting for each other after their
  #    compute, once per step) are fitted; K = 1 and K = 8 separate c0 from
  #    alpha. Collectives alone, without the compute, measured a per-message
  #    cost about half of what a step pays.
  gparams_c = global_array(params, P())
  gx_c, gy_c = global_array(xs, P("data")), global_array(ys, P("data"))
  for n, k in COLL_CASES:
    xs_k = [global_array(np.full((n,), j + 1, np.float32), P("data")) for j in range(k)]

    def body(prm, x, y, *v, gather):
      new = sgd(prm, jax.grad(loss_fn)(prm, x, y))
      s_ = jax.tree.leaves(new)[0].ravel()[0]
      coll = ((lambda a: lax.all_gather(a, "data", to="invarying")) if gather
              else (lambda a: lax.psum(a, "data")))
      return new, tuple(coll(a + s_) for a in v)

    for kind in ("allreduce", "allgather"):
      f = jax.jit(jax.shard_map(functools.partial(body, gather=kind == "allgather"), mesh=mesh,
                                in_specs=(P(), P("data"), P("data")) + (P("data"),) * k,
                                out_specs=(P(), (P(),) * k), check_vma=False))
      timed[f"coll:{kind}:{4 * n}:{k}"] = (
          lambda f=f, a=xs_k: time_fn(f, gparams_c, gx_c, gy_c, *a, repeats=args.burst, warmup=1))

  sizes = sorted(set(int(np.prod(a.shape)) for a in jax.tree.leaves(params)))
  out["codec_sizes"] = sizes
  codec_runs = {}
  for spec in args.compressors:
    if spec in OPTIMIZER_SPECS:  # inside the step's exchange (--compute local)
      continue
    name, kw = parse_compressor_spec(spec)
    comp = jaxcomp.compressors.get(name, **kw)
    if getattr(comp, "own_exchange", False):
      # PowerSGD has no encode/decode of its own to time: its matrix
      # products run inside its exchange, which the one-device step of (3)
      # includes (--compute local).
      continue
    with jax.default_device(local):
      codec_runs[spec] = codec_timers(comp, sizes)

  # 3. Real training steps with jaxcomp.compressed_mean, and (4.) the same
  #    step on a one-device mesh of this process: the transform,
  #    encode/decode and compute without any network (XLA drops collectives
  #    over one device); ``--compute local`` predicts from it.
  def build_step(spec, on_mesh, prm, batch):
    """(jitted step, carry [TrainState]) of compressor ``spec``, warmed up."""
    if spec == "adam":
      tx = optax.chain(jaxcomp.compressed_mean("identity", "data", nonfinite="zero"),
                       optax.adam(OPTIMIZER_LR))
    elif spec in OPTIMIZER_SPECS:
      tx = getattr(jaxcomp, spec)(OPTIMIZER_LR, axis_name="data", freeze_step=1)
    else:
      name, kw = parse_compressor_spec(spec)
      tx = optax.chain(jaxcomp.compressed_mean(name, "data", nonfinite="zero", **kw),
                       optax.sgd(lr))
    state = jaxcomp.init(tx, prm, on_mesh)

    step = jaxcomp.make_train_step(lambda p_, b: loss_fn(p_, *b), tx,
                                   mesh=on_mesh, donate=False,
                                   per_device_loss=True)
    carry = [state, None]
    for _ in range(3):  # compile and warm up (past a freeze_step of 1)
      carry[0], carry[1] = jax.block_until_ready(step(carry[0], batch))
    return step, carry

  def step_call(step, carry, batch):
    """One training step that advances ``carry`` ([TrainState, its loss])."""
    def call():
      carry[0], carry[1] = jax.block_until_ready(step(carry[0], batch))
    return call

  def last_loss(carry):
    """The mean of the last step's per-device losses (a Python float)."""
    return float(np.mean(np.asarray(jax.device_get(
        [s.data for s in carry[1].addressable_shards]))))

  gparams = global_array(params, P())
  gbatch = (global_array(xs, P("data")), global_array(ys, P("data")))
  local_mesh = jax.sharding.Mesh(np.array(jax.local_devices()[:1]), ("data",))
  lparams = jax.device_put(params, NamedSharding(local_mesh, P()))
  lbatch = jax.device_put((xs, ys), NamedSharding(local_mesh, P("data")))
  train, wire, ops, msgs = {}, {}, {}, {}
  out["wire_bytes"] = wire
  out["collective_ops"] = ops
  out["collective_messages"] = msgs
  out["leaf_sizes"] = [int(np.prod(a.shape)) for a in jax.tree.leaves(params)]
  carries = {}  # (spec, "mesh" | "local") -> carry, for the losses at the end
  for spec in args.compressors:
    step, carry = build_step(spec, mesh, gparams, gbatch)
    carries[(spec, "mesh")] = carry
    # What the compiled program really puts into collectives (XLA:CPU, for
    # one, promotes a bf16 all-reduce to f32).
    traffic = jaxcomp.collective_traffic(step.lower(carry[0], gbatch).compile())
    wire[spec] = traffic.operand_bytes
    ops[spec] = len(traffic.ops)
    msgs[spec] = traffic.messages
    train[spec] = burst_timer(step_call(step, carry, gbatch), barrier=False)
    lstep, lcarry = build_step(spec, local_mesh, lparams, lbatch)
    carries[(spec, "local")] = lcarry
    timed[f"local_step:{spec}"] = burst_timer(step_call(lstep, lcarry, lbatch), after_barrier)

  # Interleaved rounds: background load on this shared machine then affects
  # the link measurements, the compute and the training steps alike.
  for _ in range(2):  # warm up the collectives
    for f in timed.values():
      f()
  samples = {k: [] for k in timed}
  codec_samples = {s: [] for s in codec_runs}
  step_samples = {s: [] for s in args.compressors}
  out["loadavg"] = []  # per round, (1, 5, 15 min), at the round's start
  for _ in range(args.steps):
    out["loadavg"].append(os.getloadavg())
    for k, f in timed.items():
      samples[k].append(f())
    for spec, run in codec_runs.items():
      codec_samples[spec].append(run())
    for spec, one in train.items():
      step_samples[spec].append(one())
  med = statistics.median
  t1 = samples["single_worker_step"]
  out["collectives"] = [{"kind": k.split(":")[1], "bytes": int(k.split(":")[2]),
                         "count": int(k.split(":")[3]), "after_compute": True,
                         "seconds": med(t - c for t, c in zip(v, t1)), "all": v}
                        for k, v in samples.items() if k.startswith("coll:")]
  out["local_steps_all"] = {k.split(":", 1)[1]: v for k, v in samples.items()
                            if k.startswith("local_step:")}
  out["local_steps"] = {k: med(v) for k, v in out["local_steps_all"].items()}
  out["single_worker_step"] = med(samples["single_worker_step"])
  out["single_worker_all"] = samples["single_worker_step"]
  out["codecs"] = {s: dict(ZERO_CODEC, device="inside the exchange (own_exchange)")
                   for s in args.compressors if s not in codec_runs}
  for spec, runs in codec_samples.items():
    enc = [med(r[0][i] for r in runs) for i in range(len(sizes))]
    dec = [med(r[1][i] for r in runs) for i in range(len(sizes))]
    out["codecs"][spec] = fit_codec(sizes, enc, dec, device_name()).to_dict()
  out["steps"] = {s: {"median": med(v), "all": v} for s, v in step_samples.items()}
  # A non-finite loss means the steps timed were not training steps (a
  # compressed optimizer skips its exchange on a NaN gradient).
  out["last_loss"] = {f"{s}:{where}": last_loss(c) for (s, where), c in carries.items()}
  for s in args.compressors:
    if s in OWN_EXCHANGE:
      t = jaxcomp.get_stats(carries[(s, "mesh")][0].opt_state)
      out.setdefault("optimizer_steps", {})[s] = {
          f: getattr(t, f) for f in ("dense_steps", "compressed_steps", "silent_steps",
                                      "skipped_steps")}
  out["codec_samples"] = codec_samples
  path = args.result if jax.process_index() == 0 else f"{args.result}.rank{jax.process_index()}"
  with open(path, "w") as f:
    json.dump(out, f)
  jax.distributed.shutdown()


# --------------------------------------------------------- orchestrator ---

def fit_alpha_beta(collectives, p, kinds=("allreduce", "allgather")):
  """Fits ``t = c0 + K·(a·alpha + b·beta)`` to the measured
  collectives, ``a`` and ``b`` the ring model's coefficients for one message,
  ``K`` the messages (operands) per program.

  Returns ``(alpha, beta, c0)`` in seconds, seconds per byte, seconds. The
  per-program ``c0`` (for collectives measured after the step's compute: the
  workers waiting for each other) is fitted only where some program had more
  than one message; otherwise it is 0 and alpha absorbs it.
  """
  import numpy as np
  from jaxcomp import wire
  rows, ts = [], []
  for c in collectives:
    if c["kind"] not in kinds:
      continue
    m, k = c["bytes"], c.get("count", 1)
    kind = "all-reduce" if c["kind"] == "allreduce" else "all-gather"
    rows.append((k * wire.ring_messages(kind, p), k * wire.ring_bytes(kind, m, p), 1.0))
    ts.append(c["seconds"])
  A, t = np.array(rows), np.maximum(np.array(ts), 1e-5)  # a noisy difference may be <= 0
  multi = any(c.get("count", 1) > 1 for c in collectives if c["kind"] in kinds)
  # Hockney-style, in two alternating stages: beta from the large messages
  # (>= 512 KiB), which dominate a step's time, given alpha and c0; alpha
  # and c0 from the small ones (<= 64 KiB) given beta. One least-squares fit
  # over all sizes at once let the many small messages pull beta off the
  # large ones' (gloo over tbf is not exactly affine in the size).
  msg = np.array([c["bytes"] for c in collectives if c["kind"] in kinds])
  large = msg >= (1 << 19)
  if not large.any() or large.all():
    raise ValueError("need collectives of both small (< 512 KiB) and large (>= 512 KiB) "
                     f"messages to fit alpha and beta; got sizes {sorted(set(msg.tolist()))}")
  from scipy.optimize import nnls
  alpha = beta = c0 = 0.0
  for _ in range(500):
    before = (alpha, beta, c0)
    rest = t[large] - A[large, 0] * alpha - c0
    beta = max(float(np.sum(rest * A[large, 1]) / np.sum(A[large, 1] ** 2)), 0.0)
    y = t[~large] - A[~large, 1] * beta
    cols = [0, 2] if multi else [0]
    coef, _ = nnls(A[~large][:, cols] / t[~large, None], y / t[~large])  # relative errors
    alpha, c0 = float(coef[0]), (float(coef[1]) if multi else 0.0)
    if np.allclose(before, (alpha, beta, c0), rtol=1e-12, atol=0):
      break
  if beta <= 0:
    raise ValueError("the measured collectives do not grow with their size; "
                     "cannot fit beta (rerun on a quieter machine)")
  return alpha, beta, c0


NOMINAL_BITS = {"100mbit": 1e8, "1gbit": 1e9, "10gbit": 1e10}  # tc tbf rates, bit/s
NOMINAL_ALPHA = 50e-6  # s per message: jaxcomp whatif's default (assumed)


def fit_startup(collectives, p, rate):
  """The link as ``--fit startup`` prices it: the bandwidth is the link's
  rate as named (``rate``, the tc tbf rate, as a user names the network to
  ``jaxcomp whatif``), and the start-up cost of one message is measured,
  per collective kind, as the marginal cost of one more operand of a
  small collective: ``(t(K) - t(1)) / (K - 1)`` at the smallest measured
  size with K = 1 and K > 1 operands, per ring message, less its bytes at
  the rate.

  A difference of two programs that both run the step's compute and
  then synchronise the workers, so the compute, its noise and the
  per-step synchronisation cancel; no per-step sync is fitted. (The
  alternating fit of :func:`fit_alpha_beta` trades those three against
  each other: on a 2-core machine whose compute varies by +-20% it put
  13 to 15 ms of sync into every step in one run, and tbf's burst pulls
  its start-up cost to 0 in others.)

  On a link with no rate to name (``"unlimited"``) the bandwidth is
  measured instead, per kind, from the difference between the two largest
  single-operand collectives.

  Returns ``{kind: (alpha, beta)}`` for ``"allreduce"`` and
  ``"allgather"``: seconds per message, seconds per byte.

  Raises:
    ValueError: the collectives lack a small size with 1 and more
      operands (or, on an unrated link, two sizes of one operand), or the
      extra operands (the larger message) did not cost more (a noisy run).
  """
  from jaxcomp import wire
  out = {}
  for kind in ("allreduce", "allgather"):
    name = "all-reduce" if kind == "allreduce" else "all-gather"
    t = {(c["bytes"], c.get("count", 1)): c["seconds"]
         for c in collectives if c["kind"] == kind}
    if rate in NOMINAL_BITS:
      beta = 8 / NOMINAL_BITS[rate]
    else:  # no rate to name (unlimited): the two largest messages' difference
      big = sorted(m for m, k in t if k == 1)[-2:]
      if len(big) < 2:
        raise ValueError(f"an unrated link ({rate!r}) needs {kind} collectives of two "
                         f"sizes with 1 operand; got {sorted(t)}")
      beta = ((t[(big[1], 1)] - t[(big[0], 1)])
              / (wire.ring_bytes(name, big[1], p) - wire.ring_bytes(name, big[0], p)))
      if beta <= 0:
        raise ValueError(f"{kind} of {big[1]} bytes took no longer than of {big[0]}; "
                         "cannot measure the bandwidth (rerun on a quieter machine)")
    pairs = sorted((m, k) for m, k in t if k > 1 and (m, 1) in t)
    if not pairs:
      raise ValueError(f"need {kind} collectives of one size with 1 and more operands; "
                       f"got {sorted(t)}")
    m, k = pairs[0]
    per_operand = (t[(m, k)] - t[(m, 1)]) / (k - 1)
    alpha = (per_operand - wire.ring_bytes(name, m, p) * beta) / wire.ring_messages(name, p)
    if alpha <= 0:
      raise ValueError(f"{k} {kind} operands of {m} bytes took no longer than 1 "
                       f"({t[(m, k)] * 1e3:.2f} against {t[(m, 1)] * 1e3:.2f} ms); "
                       "rerun on a quieter machine")
    out[kind] = (alpha, beta)
  return out


ZERO_CODEC = {"encode_fixed": 0.0, "encode_per_element": 0.0,
              "decode_fixed": 0.0, "decode_per_element": 0.0}


class OnWire:
  """A compressor whose payload bytes are scaled to what the compiled
  program's collectives carry (same linear / biased; one that runs its own
  exchange, PowerSGD, is priced as the all-reduces its step sends)."""

  def __init__(self, inner, factor):
    self.inner, self.factor = inner, factor
    self.linear = inner.linear or getattr(inner, "own_exchange", False)
    self.biased = getattr(inner, "biased", False)

  def payload_bytes(self, n):
    return self.inner.payload_bytes(n) * self.factor


def predict_run(res, specs, *, from_hlo=True, compute="single", fit="startup"):
  from jaxcomp import compressors
  from jaxcomp import perfmodel as pm
  from jaxcomp.cli import parse_compressor_spec
  p = res["nproc"]
  # One alpha and one beta for the link, fitted to all the measured
  # all-reduces and all-gathers together, and (fit="per-kind") one pair per
  # collective kind: gloo's all-gather is not the ideal ring (at 100 Mbit it
  # moves the same bytes 1.3-1.45x slower than its all-reduce).
  kinds = None  # {"allreduce" | "allgather": (alpha, beta)}, one link per kind
  if fit == "nominal":
    # Not fitted: the tc rate as the bandwidth and jaxcomp whatif's assumed
    # start-up cost, as a user would ask the model; no per-step sync. The
    # link fit needs collectives that stand out of the compute's noise,
    # which a heavily loaded machine does not give.
    if res.get("rate") not in NOMINAL_BITS:
      raise ValueError(f"--fit nominal needs a link of {', '.join(NOMINAL_BITS)}")
    alpha, beta, c0 = NOMINAL_ALPHA, 8 / NOMINAL_BITS[res["rate"]], 0.0
  elif fit == "startup":
    kinds = fit_startup(res["collectives"], p, res.get("rate"))
    beta = kinds["allreduce"][1]
    alpha, c0 = statistics.mean(a for a, _ in kinds.values()), 0.0
  else:
    alpha, beta, c0 = fit_alpha_beta(res["collectives"], p)
    if fit == "per-kind":
      kinds = {kind: fit_alpha_beta(res["collectives"], p, kinds=(kind,))[:2]
               for kind in ("allreduce", "allgather")}
  fits = {"link": (alpha, beta)}
  per_kind = None
  if kinds:
    fits.update(kinds)
    per_kind = {"all-reduce": pm.Link(*kinds["allreduce"]),
                "all-gather": pm.Link(*kinds["allgather"])}
    # Not calibrated: the all-to-all (two-phase's first phase) is priced on
    # the all-gather's link; both are (p - 1) point-to-point exchanges.
    per_kind["all-to-all"] = per_kind["all-gather"]
  prof = pm.ModelProfile.from_dict(res["profile"])
  # profile gives the per-tensor split; its total is rescaled to the
  # one-worker step timed in the same interleaved rounds as the training
  # (compute="profile": not rescaled, the profile's own times as measured
  # once before the rounds, while every worker profiled).
  if compute != "profile":
    prof = prof.scaled(res["single_worker_step"] / prof.compute_time)
  net = pm.Network(p, pm.Link(alpha, beta), per_collective=per_kind)
  comps = {}
  for spec in specs:
    if spec in OWN_EXCHANGE:
      # The library's own transfers (the optimizer's phase_transfers), all
      # steps after the freeze.
      comps[spec] = pm.CompressedOptimizer(spec, steps=1_000_000, freeze_step=1)
      continue
    name, kw = parse_compressor_spec("identity" if spec == "adam" else spec)
    comps[spec] = compressors.get(name, **kw)
    if from_hlo:
      formula = sum(comps[spec].payload_bytes(n) for n in res["leaf_sizes"])
      comps[spec] = OnWire(comps[spec], res["wire_bytes"][spec] / formula)
  codecs = {s: pm.CodecCost.from_dict(res["codecs"][s]) for s in specs}
  # XLA:CPU runs the step's collectives in program order on the compute
  # thread, so nothing overlaps the backward pass. The buckets are what the
  # compiled program sends: compressed_mean's default plan (below), and a
  # payload of k arrays travels as k messages. XLA's
  # combiner merges same-typed collectives into one tuple-shaped op, but
  # XLA:CPU still runs one gloo collective per operand.
  if compute == "local":
    # Compute, transform and encode/decode as one measured local step.
    if "local_steps" not in res:
      raise ValueError("--compute local needs runs with local_steps (rerun)")
    zero = pm.CodecCost.from_dict(dict(ZERO_CODEC, device="local step"))
    codecs = {s: zero for s in specs}
  leaves = len(res["leaf_sizes"])
  # Synchronisation: the workers wait for each other once per step, c0 of
  # the collectives measured after the compute (older files: none).
  sync = c0 if p > 1 and any(c.get("after_compute") for c in res["collectives"]) else 0.0
  fits["sync"] = sync
  preds = {}
  for s in specs:
    if compute == "local":
      prof_s = pm.ModelProfile.from_dict(res["profile"])
      prof_s = prof_s.scaled(res["local_steps"][s] / prof_s.compute_time)
    else:
      prof_s = prof
    if s in OWN_EXCHANGE:
      # --compute local: compute, 1-bit encode/decode and the update as the
      # one-device step measured them; otherwise the compute alone.
      preds[s] = pm.predict(prof_s, comps[s], net, buckets="layer", overlap="serial")
      if sync:
        preds[s] = dataclasses.replace(
            preds[s], step_time=preds[s].step_time + sync,
            compute_time=preds[s].compute_time + sync,
            scaling_factor=prof_s.compute_time / (preds[s].step_time + sync))
      continue
    # Messages, not ops: a tuple-shaped collective runs one gloo collective
    # per operand (older result files only have the op count).
    n_msgs = len(res["collective_messages"][s]) if "collective_messages" in res \
        else res["collective_ops"][s]
    # Compressors that are not linear go through jaxcomp's default
    # collective for them: Auto (two-phase where it moves fewer bytes, as
    # the compiled step's all-to-alls show) or the all-gather.
    kinds = {k for k, _ in res["collective_messages"][s]} if "collective_messages" in res else set()
    coll = None
    if not comps[s].linear and "all-to-all" in kinds:
      coll = "auto"
    # The buckets: compressed_mean's default plan (bucketing="auto": a large
    # tensor alone, the small ones packed into one bucket) for a compressor
    # that encodes; a linear one without its own exchange (dense) is one
    # all-reduce per tensor, which XLA combines into one op of one operand
    # per tensor.
    per_bucket = 2 if coll else 1  # two-phase: two collectives per array
    inner = getattr(comps[s], "inner", comps[s])  # under OnWire
    dense = inner.linear and not getattr(inner, "own_exchange", False)
    plan = "layer" if dense else "auto"
    n_buckets = len(pm.bucket_plan(plan, prof_s))
    if n_msgs == 1:
      buckets, msgs = "single", 1
    elif n_msgs % (n_buckets * per_bucket) == 0:
      buckets, msgs = plan, n_msgs // (n_buckets * per_bucket)
    else:  # a plan this script does not know: per tensor, messages averaged
      buckets, msgs = "layer", max(1, round(n_msgs / leaves / per_bucket))
    # from_hlo: the compiled step's bytes and messages (OnWire); otherwise
    # the library's own collective and transfers, as compressed_mean runs.
    how = dict(messages_per_bucket=msgs, collective=coll) if from_hlo else {}
    if not from_hlo:
      buckets = plan
    preds[s] = pm.predict(prof_s, comps[s], net, codec=codecs[s], buckets=buckets,
                          overlap="serial", **how)
    extra = sync
    if compute == "local" and not comps[s].linear:
      # The one-device step encodes each bucket once and decodes it once
      # (twice with error feedback); p devices do the codec work the model
      # charges (all-gather: p decodes; two-phase: chunk encodes, decodes
      # and a re-encode). Add the difference, micro-benchmarked.
      # Per-element costs only: the micro-benchmark's fixed part is the
      # dispatch of a jitted call of its own, which a fused step does not
      # pay per bucket or per chunk (two-phase encodes its chunks vmapped).
      dec = pm.CodecCost.from_dict(dict(res["codecs"][s], encode_fixed=0.0, decode_fixed=0.0))
      full = pm.predict(prof_s, comps[s], net, codec=dec, buckets=buckets, overlap="serial",
                        **how)
      ef = 2 if getattr(comps[s], "biased", False) else 1
      one = sum(dec.encode(n) + ef * dec.decode(n) for n in res["leaf_sizes"])
      extra += max(0.0, full.codec_time - one)
    if extra:
      preds[s] = dataclasses.replace(
          preds[s], step_time=preds[s].step_time + extra,
          compute_time=preds[s].compute_time + extra, codec_time=preds[s].codec_time + extra,
          scaling_factor=prof_s.compute_time / (preds[s].step_time + extra))
  return fits, preds


def run_one(cluster, nproc, rate, args, tmpdir):
  result = os.path.join(tmpdir, f"r{nproc}_{rate}.json")
  import netns  # benchmarks/netns.py, beside this script
  burst = (netns.burst_for(rate, args.tbf_burst_ms)
           if args.tbf_burst_ms is not None and rate != "unlimited" else None)
  cluster.set_rate(None if rate == "unlimited" else rate, burst=burst)
  coord = f"{cluster.namespaces[0].address}:{args.port}"
  procs, logs = [], []
  for i in range(nproc):
    log = open(os.path.join(tmpdir, f"w{nproc}_{rate}_{i}.log"), "w")
    logs.append(log)
    # --pin gives each worker one core, like one host each; gloo's network
    # thread then shares that core with XLA's compute thread and every
    # message waits for a scheduler slot (about 4 ms per message here).
    pin = ["taskset", "-c", str(i % os.cpu_count())] if args.pin else []
    argv = [*pin, sys.executable, os.path.abspath(__file__),
            "--worker", "--rank", str(i), "--nproc", str(nproc), "--coordinator", coord,
            "--result", result, "--steps", str(args.steps), "--burst", str(args.burst),
            "--compute-after-barrier", args.compute_after_barrier,
            "--model", args.model, "--compressors", *args.compressors]
    procs.append(cluster.popen(i, argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
  deadline = time.time() + args.timeout
  try:
    for pr in procs:
      pr.wait(timeout=max(1, deadline - time.time()))
  except subprocess.TimeoutExpired:
    raise RuntimeError(f"{nproc} workers at {rate} did not finish in {args.timeout} s "
                       f"(logs in {tmpdir})") from None
  finally:
    cluster.kill_all()
    for log in logs:
      log.close()
  # A worker that wrote its result and then failed in jax.distributed's
  # shutdown (the coordinator, rank 0, gone first; seen on a loaded
  # machine) has measured everything.
  written = [result] + [f"{result}.rank{r}" for r in range(1, nproc)]
  bad = [i for i, pr in enumerate(procs) if pr.returncode and not os.path.exists(written[i])]
  if bad or not os.path.exists(result):
    tail = open(os.path.join(tmpdir, f"w{nproc}_{rate}_{bad[0] if bad else 0}.log")).read()[-3000:]
    raise RuntimeError(f"workers {bad} failed at {rate}:\n{tail}")
  with open(result) as f:
    res = json.load(f)
  others = []
  for r in range(1, nproc):
    with open(f"{result}.rank{r}") as f:
      others.append(json.load(f))
  return merge_ranks(res, others)


def merge_ranks(res, others):
  """Synchronous data parallelism runs at the pace of its slowest worker: per
  measurement round, the compute and encode/decode times of the model are
  the maximum over the workers (this shared machine gives them unequal CPU)."""
  everyone = [res] + others
  rounds = len(res["single_worker_all"])
  t1 = [max(w["single_worker_all"][i] for w in everyone) for i in range(rounds)]
  res["single_worker_all_ranks"] = [w["single_worker_all"] for w in everyone]
  res["single_worker_all"] = t1
  res["single_worker_step"] = statistics.median(t1)
  for spec, mine in res.get("local_steps_all", {}).items():
    res["local_steps"][spec] = statistics.median(
        max(w["local_steps_all"][spec][i] for w in everyone) for i in range(len(mine)))
  sizes = res["codec_sizes"]
  from jaxcomp.perfmodel.codec import fit_codec
  for spec in res.get("codec_samples", {}):
    enc = [statistics.median(max(w["codec_samples"][spec][i][0][k] for w in everyone)
                             for i in range(rounds)) for k in range(len(sizes))]
    dec = [statistics.median(max(w["codec_samples"][spec][i][1][k] for w in everyone)
                             for i in range(rounds)) for k in range(len(sizes))]
    res["codecs"][spec] = fit_codec(sizes, enc, dec, res["codecs"][spec]["device"]).to_dict()
  for w in everyone:
    w.pop("codec_samples", None)
  return res


def formula_bytes(spec, n, workers=2):
  from jaxcomp import compressors, optimizers, wire
  from jaxcomp.cli import parse_compressor_spec
  if spec in OWN_EXCHANGE:  # one 1-bit exchange's operand bytes
    return wire.operand_bytes(optimizers.phase_transfers(
        [int(n)], {"data": workers})["compressed"])
  name, kw = parse_compressor_spec("identity" if spec == "adam" else spec)
  return compressors.get(name, **kw).payload_bytes(n)


def report(runs, specs, print_=print, compute="single", fit="startup"):
  lines = []
  say = lambda s="": (lines.append(s), print_(s))
  table = []
  for key, res in runs.items():
    nproc, rate = key
    res["rate"] = rate
    try:
      fits, preds = predict_run(res, specs, compute=compute, fit=fit)
    except ValueError as e:  # a link fit that the measurements do not support
      say(f"{nproc} workers, {rate}: no prediction with --fit {fit}: {e}")
      continue
    _, formula = predict_run(res, specs, from_hlo=False, compute=compute, fit=fit)
    _, alone = predict_run(res, specs, compute="profile", fit=fit)
    alpha, beta = fits["link"]
    if fit == "startup":
      say(f"{nproc} workers, {rate}: bandwidth {8 / beta / 1e9:.3f} Gbit/s (the link's "
          f"rate), start-up per message measured: all-reduce "
          f"{fits['allreduce'][0] * 1e6:.0f} us, all-gather {fits['allgather'][0] * 1e6:.0f} us; "
          f"one-worker step {res['single_worker_step'] * 1e3:.1f} ms")
    else:
      say(f"{nproc} workers, {rate}: fitted alpha = {alpha * 1e6:.0f} us, beta = "
          f"{beta * 1e9:.2f} ns/B ({8 / beta / 1e9:.3f} Gbit/s), per-step sync "
          f"{fits['sync'] * 1e3:.2f} ms; one-worker step "
          f"{res['single_worker_step'] * 1e3:.1f} ms")
    if res.get("loadavg"):  # os.getloadavg() at each round's start
      say(f"  1-min load average per round: {', '.join(f'{la[0]:.1f}' for la in res['loadavg'])} "
          f"(machine of {os.cpu_count()} cores)")
    for kind in ("allreduce", "allgather"):
      if kind in fits and fit != "startup":
        a, b = fits[kind]
        say(f"  {kind} alone: alpha = {a * 1e6:.0f} us, beta = {b * 1e9:.2f} ns/B "
            f"({8 / b / 1e9:.3f} Gbit/s){'  (used)' if fit == 'per-kind' else ''}")
    for spec in specs:
      losses = {k: v for k, v in res.get("last_loss", {}).items()
                if k.rsplit(":", 1)[0] == spec}
      bad = {k: v for k, v in losses.items() if not math.isfinite(v)}
      if bad:  # not training steps: no measurement to compare with
        say(f"  {spec}: no comparison, the last loss was not finite ({bad}); "
            "the steps timed skipped their exchange or trained on NaN")
        continue
      meas = res["steps"][spec]["median"]
      pred = preds[spec].step_time
      table.append({
          "workers": nproc, "rate": rate, "compressor": spec, "measured_ms": meas * 1e3,
          "predicted_ms": pred * 1e3, "rel_error": (pred - meas) / meas,
          "formula_predicted_ms": formula[spec].step_time * 1e3,
          "profile_alone_predicted_ms": alone[spec].step_time * 1e3,
          # A compressed optimizer's compiled step holds both phases'
          # collectives (a cond), so its wire bytes are not one step's.
          "wire_over_formula": None if spec in OWN_EXCHANGE else
          res["wire_bytes"][spec] / sum(
              formula_bytes(spec, n, nproc) for n in res["leaf_sizes"]),
          "measured_speedup": res["steps"][specs[0]]["median"] / meas,
          "predicted_speedup": preds[specs[0]].step_time / pred,
          "measured_scaling": res["single_worker_step"] / meas,
          "predicted_scaling": res["single_worker_step"] / pred,
          "alpha_us": alpha * 1e6, "beta_ns_per_byte": beta * 1e9})
  say()
  hdr = ("workers", "link", "compressor", "measured ms", "predicted ms", "error",
         "speedup meas", "speedup pred", "scaling meas", "scaling pred", "wire/formula",
         "pred. formula bytes", "pred. profile alone")
  rows = [(str(r["workers"]), r["rate"], r["compressor"], f"{r['measured_ms']:.1f}",
           f"{r['predicted_ms']:.1f}", f"{100 * r['rel_error']:+.1f}%",
           f"{r['measured_speedup']:.2f}", f"{r['predicted_speedup']:.2f}",
           f"{r['measured_scaling']:.3f}", f"{r['predicted_scaling']:.3f}",
           "n/a" if r["wire_over_formula"] is None else f"{r['wire_over_formula']:.2f}",
           f"{r['formula_predicted_ms']:.1f} ({100 * (r['formula_predicted_ms'] / r['measured_ms'] - 1):+.0f}%)",
           f"{r['profile_alone_predicted_ms']:.1f} "
           f"({100 * (r['profile_alone_predicted_ms'] / r['measured_ms'] - 1):+.0f}%)")
          for r in table]
  w = [max(len(x[i]) for x in rows + [hdr]) for i in range(len(hdr))]
  say(" | ".join(h.ljust(w[i]) for i, h in enumerate(hdr)))
  say("-|-".join("-" * x for x in w))
  for r in rows:
    say(" | ".join(c.ljust(w[i]) for i, c in enumerate(r)))
  say()
  worst = max(abs(r["rel_error"]) for r in table)
  say(f"largest |relative error|: {100 * worst:.1f}% (target 20%); within 20%: "
      f"{sum(abs(r['rel_error']) <= 0.2 for r in table)} of {len(table)}")
  order_ok, any_tie = [], False
  for key, res in runs.items():
    sub = [r for r in table if (r["workers"], r["rate"]) == key]
    if not sub:  # no prediction for this run
      continue
    # Compressors whose compiled steps send the same messages (XLA:CPU sends
    # a bf16 all-reduce as float32, so bf16 and identity do) differ only by
    # noise: they form one group, and the ordering is checked between groups.
    msgs = res.get("collective_messages", {})
    group = {}
    for r in sub:
      same = [g for g in group if msgs.get(g) is not None and msgs.get(g) == msgs.get(r["compressor"])]
      group[r["compressor"]] = group[same[0]] if same else r["compressor"]

    def order(field):
      out = []
      for r in sorted(sub, key=lambda r: r[field]):
        g = group[r["compressor"]]
        if g not in out:
          out.append(g)
      return out

    meas, pred = order("measured_ms"), order("predicted_ms")
    ok = meas == pred
    order_ok.append(ok)
    ties = {g: [c for c in group if group[c] == g] for g in set(group.values())}
    name = lambda g: " = ".join(ties[g])
    any_tie |= any(len(v) > 1 for v in ties.values())
    say(f"ordering {key[0]} workers {key[1]}: measured {' < '.join(map(name, meas))}"
        + ("  (predicted: same)" if ok else
           f"\n{'':>22}predicted {' < '.join(map(name, pred))}"))
  if any_tie:
    say("('a = b': the two compiled steps send the same collective messages, a tie)")
  return table, lines


def plot(table, specs, path, model=None):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  workers = sorted({r["workers"] for r in table})
  fig, axes = plt.subplots(1, len(workers), figsize=(6 * len(workers), 4.2), squeeze=False)
  xpos = {rate: i for i, rate in enumerate(RATES)}
  for ax, p in zip(axes[0], workers):
    for spec in specs[1:]:
      sub = [r for r in table if r["workers"] == p and r["compressor"] == spec]
      sub.sort(key=lambda r: xpos[r["rate"]])
      xs = [xpos[r["rate"]] for r in sub]
      line, = ax.plot(xs, [r["measured_speedup"] for r in sub], "o-", label=f"{spec} measured")
      ax.plot(xs, [r["predicted_speedup"] for r in sub], "x--", color=line.get_color(),
              label=f"{spec} predicted")
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xticks(range(len(RATES)), RATES)
    ax.set_yscale("log")
    ax.set_xlabel("link (tc tbf)")
    ax.set_ylabel("speedup over dense")
    ax.set_title(f"{p} JAX processes over gloo, {model or 'MLP ' + '-'.join(map(str, LAYERS))}")
    ax.grid(True, which="both", alpha=0.3)
  axes[0][-1].legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _raise_on_signal(signum, frame):
  raise KeyboardInterrupt(f"signal {signum}")


def load_runs(paths):
  """The runs of saved OUT.json files, ``{(workers, link): measurements}``,
  in worker and link order (``--report-from``)."""
  runs = {}
  for path in paths:
    with open(path) as f:
      for key, v in json.load(f)["runs"].items():
        p, r = key.split(":")
        runs[(int(p), r)] = v
  return dict(sorted(runs.items(), key=lambda kv: (kv[0][0], RATES.index(kv[0][1]))))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", choices=MODELS, default="mlp",
                  help="the model trained and profiled (jaxcomp.perfmodel.profile)")
  ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
  ap.add_argument("--rates", nargs="+", default=list(RATES))
  ap.add_argument("--compressors", nargs="+", default=list(COMPRESSORS),
                  help="first one is the dense baseline")
  ap.add_argument("--steps", type=int, default=10,
                  help="interleaved measurement rounds (one burst per compressor each)")
  ap.add_argument("--burst", type=int, default=8,
                  help="timed calls per round and measurement, after one untimed call, "
                  "their median kept: steady state, as in a training loop")
  ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
  ap.add_argument("--port", type=int, default=12731)
  ap.add_argument("--netns-prefix", default=None,
                  help="name prefix of the network namespaces (default: "
                  "j<pid>, unique to this run)")
  ap.add_argument("--subnet", default=None,
                  help="first three octets of the namespaces' /24 (default "
                  "derived from the pid)")
  ap.add_argument("--out", default=None, help="write OUT.txt, OUT.json and OUT.png")
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
  ap.add_argument("--nproc", type=int, help=argparse.SUPPRESS)
  ap.add_argument("--coordinator", help=argparse.SUPPRESS)
  ap.add_argument("--result", help=argparse.SUPPRESS)
  ap.add_argument("--compute", choices=("single", "local"), default="single",
                  help="the model's compute: 'single' = the one-worker step plus "
                  "measured encode/decode; 'local' = each compressor's training "
                  "step on a one-device mesh (transform included)")
  ap.add_argument("--compute-after-barrier", choices=("auto", "on", "off"), default="auto",
                  help="time the one-worker and local steps after a barrier, so that "
                  "all workers compute together as in a synchronous step; 'auto': "
                  "where workers outnumber this machine's cores")
  ap.add_argument("--tbf-burst-ms", type=float, default=None,
                  help="tbf burst as milliseconds of traffic at the link's rate "
                  "(at least 3 KiB); default: netns.py's (1 ms, at least 64 KiB, "
                  "which lets short messages through faster than the rate)")
  ap.add_argument("--pin", action="store_true",
                  help="pin worker i to core i %% cores (taskset)")
  ap.add_argument("--fit", choices=("startup", "per-kind", "link", "nominal"),
                  default="startup",
                  help="'startup' (default): the tc rate as the bandwidth and, per "
                  "collective kind, the measured start-up cost of one more operand "
                  "(fit_startup); 'per-kind': alpha, beta and a per-step sync fitted "
                  "per collective kind; 'link': one such fit for the link; 'nominal': "
                  "the tc rate and an assumed 50 us per message")
  ap.add_argument("--report-from", nargs="+", metavar="JSON",
                  help="recompute the report from saved OUT.json files (no runs)")
  args = ap.parse_args(argv)
  if args.report_from:
    runs = load_runs(args.report_from)
    sys.path.insert(0, REPO)
    head = [f"$ python benchmarks/validate_perfmodel.py {' '.join(argv or sys.argv[1:])}", ""]
    for line in head:
      print(line)
    table, rep = report(runs, args.compressors, compute=args.compute, fit=args.fit)
    if args.out:
      with open(args.out + ".txt", "w") as f:
        f.write("\n".join(head + rep) + "\n")
      with open(args.out + "_table.json", "w") as f:
        json.dump(table, f, indent=1)
      plot(table, args.compressors, args.out + ".png",
           next(iter(runs.values())).get("model"))
    return 0
  if args.worker:
    worker(args)
    return 0

  for p in args.workers:
    if not 2 <= p <= 64:
      ap.error(f"--workers must be between 2 and 64, got {p}")
  for r in args.rates:
    if r not in RATES:
      ap.error(f"--rates takes {', '.join(RATES)}, got {r!r}")
  import netns  # benchmarks/netns.py, beside this script
  try:
    netns.check_prerequisites()
  except netns.NetnsUnavailable as e:
    print(f"validate_perfmodel: refusing to run: {e}", file=sys.stderr)
    return 2

  signal.signal(signal.SIGTERM, _raise_on_signal)
  runs = {}
  t_start = time.time()
  with tempfile.TemporaryDirectory(prefix="jcmp_validate_") as tmpdir:
    for p in args.workers:
      with netns.RateLimitedCluster(p, prefix=args.netns_prefix,
                                    subnet=args.subnet) as cluster:
        for rate in args.rates:
          t0 = time.time()
          runs[(p, rate)] = run_one(cluster, p, rate, args, tmpdir)
          print(f"[{p} workers, {rate}: {time.time() - t0:.0f} s]", file=sys.stderr, flush=True)
          if args.out:  # each run as it ends, so a later failure loses nothing
            with open(args.out + ".json", "w") as f:
              json.dump({"runs": {f"{q}:{r}": v for (q, r), v in runs.items()}}, f, indent=1)
  first = next(iter(runs.values()))
  loads = [la[0] for r in runs.values() for la in r.get("loadavg", [])]
  lines = [f"$ python benchmarks/validate_perfmodel.py {' '.join(argv or sys.argv[1:])}",
           f"({len(runs)} runs in {time.time() - t_start:.0f} s; {first['model']}, batch "
           f"{first['batch_per_worker']} per worker, {args.steps} timed steps each, medians; "
           f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; 1-min load average "
           f"per round {min(loads):.2f} .. {max(loads):.2f})", ""]
  for s in lines:
    print(s)
  if args.out:  # raw measurements first, so a failing report loses nothing
    with open(args.out + ".json", "w") as f:
      json.dump({"runs": {f"{p}:{r}": v for (p, r), v in runs.items()}}, f, indent=1)
  table, rep = report(runs, args.compressors, compute=args.compute, fit=args.fit)
  if args.out:
    with open(args.out + ".txt", "w") as f:
      f.write("\n".join(lines + rep) + "\n")
    with open(args.out + ".json", "w") as f:
      json.dump({"runs": {f"{p}:{r}": v for (p, r), v in runs.items()}, "table": table},
                f, indent=1)
    plot(table, args.compressors, args.out + ".png", first["model"])
    print(f"wrote {args.out}.txt, {args.out}.json, {args.out}.png")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""One elastic DiLoCo island: a small regression model trained for ``H``
inner steps per interval, synchronized with the other islands through
:class:`jaxcomp.elastic.ElasticDiLoCo` (torchft underneath).

Start the quorum service once, then one island per name::

  jaxcomp lighthouse --bind '[::]:29510' --min-replicas 2 &
  for i in a b c; do
    python examples/elastic/island.py --island $i \\
        --lighthouse http://localhost:29510 --outer-steps 20 \\
        --checkpoint-dir /tmp/elastic_ckpt --log /tmp/elastic.$i.jsonl &
  done

Kill one (``kill -9``) and start it again with the same command: it heals
from a peer (or from ``--checkpoint-dir`` when every peer is gone).

An island of several JAX processes: start each with
``JAXCOMP_COORDINATOR_ADDRESS``, ``JAXCOMP_NUM_PROCESSES`` and
``JAXCOMP_PROCESS_ID`` (``jaxcomp launch -n 2 -- python
examples/elastic/island.py ...`` sets them); its inner steps are exact data
parallelism over the island's processes (gloo), and ``{process}`` in
``--log`` and ``--output`` becomes the process index (``{island}`` the
island's name). ``jaxcomp islands -n 3 -m 2 -- python
examples/elastic/island.py --log '/tmp/el.{island}.p{process}.jsonl'``
starts the Lighthouse and all of it.

Each event is one JSON line in ``--log`` (``ready``, ``begin``, ``mid``,
``sync``, ``done``) with the outer step, the islands in the quorum, the
anchor's sha256 and the time, which ``tests/test_elastic.py`` reads.
The data are a pure function of (island, outer step, inner step).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxcomp import distributed

distributed.initialize_from_env()

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from jaxcomp import elastic


def parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--island", default=None,
                 help="default: JAXCOMP_ISLAND (jaxcomp islands sets it)")
  p.add_argument("--lighthouse", default=None,
                 help="default: JAXCOMP_LIGHTHOUSE")
  p.add_argument("--outer-steps", type=int, default=20,
                 help="stop once this many outer steps are committed")
  p.add_argument("--stop-file", default=None,
                 help="a file holding the outer step to stop at, read at "
                 "each interval (overrides --outer-steps once it exists)")
  p.add_argument("--go-file", default=None,
                 help="wait for this file before the first quorum")
  p.add_argument("--sync-every", type=int, default=8, help="H")
  p.add_argument("--step-delay", type=float, default=0.0,
                 help="seconds slept per inner step (a slower island)")
  p.add_argument("--dim", type=int, default=64, help="model width")
  p.add_argument("--model", choices=["regression", "char_lm"],
                 default="regression",
                 help="char_lm: examples/char_lm's transformer on the "
                 "standard library's source (--dim is its d_model)")
  p.add_argument("--batch-size", type=int, default=32,
                 help="per island, split over its processes")
  p.add_argument("--train-bytes", type=int, default=500_000,
                 help="char_lm: bytes of the training stream")
  p.add_argument("--compressor", default="int8_block")
  p.add_argument("--fsdp", action="store_true",
                 help="shard every parameter's rows over the island's "
                 "devices (FSDP): each process syncs its own rows, with no "
                 "gather")
  p.add_argument("--min-islands", type=int, default=1)
  p.add_argument("--wait-for", type=int, default=None,
                 help="islands to wait for before the first commit "
                 "(default: JAXCOMP_WAIT_FOR, set by jaxcomp islands "
                 "--wait-for, else 1)")
  p.add_argument("--checkpoint-dir", default=None)
  p.add_argument("--timeout", type=float, default=10.0)
  p.add_argument("--quorum-timeout", type=float, default=60.0)
  p.add_argument("--log", default=None)
  p.add_argument("--output", default=None, help="final anchor, .npz")
  return p.parse_args(argv)


class Model(NamedTuple):
  params: Any
  inner: optax.GradientTransformation
  inner_name: str
  loss: Callable  # (params, x, y) -> scalar
  batch: Callable  # (island seed, outer step, inner step) -> (x, y)
  valid_loss: Callable  # anchor -> float, held-out loss (nats)


def make_model(args) -> Model:
  """The regression model (synthetic data) or the character LM."""
  b = args.batch_size
  if args.model == "regression":
    d = args.dim
    w_true = jax.random.normal(jax.random.key(1), (d, 4))
    loss = lambda p, x, y: jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    def batch(seed, step, i):
      k = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), i)
      x = jax.random.normal(k, (b, d))
      return x, x @ w_true

    xv = jax.random.normal(jax.random.key(2), (256, d))
    return Model({"w": jnp.zeros((d, 4), jnp.float32),
                  "b": jnp.zeros((4,), jnp.float32)}, optax.adam(1e-2),
                 "adam(1e-2)", loss, batch,
                 lambda p: float(jax.jit(loss)(p, xv, xv @ w_true)))
  # The repository's root, for examples.char_lm (run as a script, only
  # this file's folder is on the path).
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))))
  from examples.char_lm import data as data_lib
  from examples.char_lm import train as train_lib
  from examples.char_lm.config import Config
  config = Config(d_model=args.dim, context=64, num_layers=2, num_heads=4)
  net, params = train_lib.init_model(config)
  corpus = data_lib.load(max_train_bytes=args.train_bytes)
  length = config.context + 1
  valid = data_lib.fixed_windows(corpus.valid, 64, length)

  def loss(p, x, y):
    logits = net.apply({"params": p}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def batch(seed, step, i):
    w = data_lib.random_windows(corpus.train, b, length,
                                np.random.default_rng([seed, step, i]))
    return w[:, :-1], w[:, 1:]

  return Model(params, optax.adam(3e-3), "adam(3e-3)", loss, batch,
               lambda p: float(jax.jit(loss)(p, valid[:, :-1], valid[:, 1:])))


def _digest(tree) -> str:
  """The digest of this process's part of ``tree`` (its rows of a leaf
  sharded over the island: process r of every island holds the same
  ones)."""
  return elastic.digest(jax.tree.map(
      lambda x: x.addressable_data(0) if isinstance(x, jax.Array)
      and not x.is_fully_addressable else x, tree))


def _island_seed(name: str) -> int:
  return sum(ord(c) * 31**i for i, c in enumerate(name)) % (2**31)


def main(argv=None) -> int:
  args = parse(argv)
  args.island = args.island or os.environ["JAXCOMP_ISLAND"]
  me = str(jax.process_index())
  fill = lambda path: path.replace("{process}", me).replace("{island}",
                                                           args.island)
  log = open(fill(args.log), "a") if args.log else sys.stdout
  mesh = jax.make_mesh((jax.device_count(),), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  replicated = lambda tree: distributed.global_array(tree, mesh, P())

  def say(event, **kw):
    log.write(json.dumps({"event": event, "island": args.island,
                          "t": time.time(), **kw}) + "\n")
    log.flush()

  model = make_model(args)
  params = model.params
  if args.fsdp:  # rows over the island's devices; they stay sharded
    params = distributed.global_array(params, mesh, P("data"))
    replicated = lambda tree: tree
  inner = model.inner
  isl = elastic.ElasticDiLoCo(
      params, island=args.island, lighthouse=args.lighthouse,
      compressor=args.compressor, min_islands=args.min_islands,
      wait_for=args.wait_for,
      checkpoint_dir=args.checkpoint_dir, timeout=args.timeout,
      quorum_timeout=args.quorum_timeout,
      config={"sync_every": args.sync_every, "model": args.model,
              "inner": model.inner_name})

  @jax.jit
  def train_step(p, s, x, y):
    loss, g = jax.value_and_grad(model.loss)(p, x, y)
    u, s = inner.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  seed = _island_seed(args.island)
  inner_state = replicated(jax.jit(inner.init)(params))
  # The inner step compiled before the first quorum: a joiner's first
  # interval is then no slower than its peers', who wait for it at the
  # exchange (at most --timeout seconds).
  x, y = distributed.global_array(model.batch(seed, 0, 0), mesh, P("data"))
  jax.block_until_ready(train_step(replicated(isl.anchor), inner_state, x, y))
  say("ready", step=isl.step, restored=isl.restored_step,
      anchor=_digest(isl.anchor))
  if args.go_file:
    while not os.path.exists(args.go_file):
      time.sleep(0.05)
  loss = jnp.float32(0)
  while True:
    stop = args.outer_steps
    if args.stop_file and os.path.exists(args.stop_file):
      stop = int(open(args.stop_file).read())
    if isl.step >= stop:
      break
    p = replicated(isl.begin())
    say("begin", step=isl.step, islands=isl.islands, healed=isl.healed,
        heal_seconds=isl.heal_seconds if isl.healed else None,
        heal_bytes=isl.heal_bytes if isl.healed else None,
        anchor=_digest(isl.anchor), residual=elastic.digest(isl.residual))
    if isl.healed:
      inner_state = replicated(jax.jit(inner.init)(isl.anchor))
    for i in range(args.sync_every):
      x, y = model.batch(seed, isl.step, i)
      x, y = distributed.global_array((x, y), mesh, P("data"))
      p, inner_state, loss = train_step(p, inner_state, x, y)
      loss.block_until_ready()
      if i == args.sync_every // 2:
        say("mid", step=isl.step)
      time.sleep(args.step_delay)
    r = isl.sync(p)
    say("sync", step=r.step, committed=r.committed, islands=r.islands,
        anchor=_digest(isl.anchor), residual=elastic.digest(isl.residual),
        loss=float(loss.addressable_data(0)),
        seconds=r.seconds, bytes=r.bytes_sent, pg_bytes=isl.exchange_bytes,
        gather_bytes=isl.gather_bytes,
        error=None if r.error is None else repr(r.error)[:300])
  # The whole anchor on every process (FSDP: gathered once, at the end).
  anchor = (multihost_utils.process_allgather(isl.anchor, tiled=True)
            if args.fsdp else isl.anchor)
  valid = model.valid_loss(anchor)
  if args.output:
    np.savez(fill(args.output), **{k: np.asarray(v) for k, v in anchor.items()})
  say("done", step=isl.step, anchor=elastic.digest(anchor), valid_loss=valid)
  isl.close()
  distributed.shutdown()
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

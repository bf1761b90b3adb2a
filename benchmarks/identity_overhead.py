"""What compression switched off costs: ``compressed_mean("identity")``
against the same model's plain step, in two idioms.

A small NNX GPT (about 110k parameters: 2 blocks, d_model 64, 4 heads,
context 64, vocabulary 96), Adam, global batch 32, timed as

* the functional route: ``jaxcomp.init`` + ``jaxcomp.make_train_step`` with
  ``optax.chain(jaxcomp.compressed_mean("identity", "data"), adam)``
  against a plain ``jax.jit`` step (``jax.value_and_grad`` of the loss of
  the data-sharded global batch, then Adam);
* the NNX route: ``jaxcomp.flax.Optimizer`` + ``jaxcomp.flax.train_step``
  against ``nnx.Optimizer`` + an ``nnx.jit`` step;

on one CPU device and on 8 simulated ones (a process each). Steps are timed
in interleaved rounds (a few of each in turn, each waited for), medians over
all timed steps; the ratio is jaxcomp's median over the plain one. It also
compares the compiled functional steps' collectives (kinds and operand
bytes, :func:`jaxcomp.collective_traffic`)::

  python benchmarks/identity_overhead.py
  python benchmarks/identity_overhead.py --devices 8 --steps 200 --rounds 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(args) -> dict:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.worker}")
  sys.path.insert(0, REPO)
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P

  import jaxcomp
  import jaxcomp.flax

  vocab, context, d, heads, batch = 96, 64, 64, 4, 32

  class Block(nnx.Module):

    def __init__(self, rngs):
      self.ln1 = nnx.LayerNorm(d, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
      self.ln2 = nnx.LayerNorm(d, rngs=rngs)
      self.up = nnx.Linear(d, 4 * d, rngs=rngs)
      self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x, mask):
      x = x + self.attn(self.ln1(x), mask=mask)
      return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))

  class GPT(nnx.Module):

    def __init__(self, rngs):
      self.embed = nnx.Embed(vocab, d, rngs=rngs)
      self.pos = nnx.Param(jax.random.normal(rngs.params(), (context, d)) * 0.02)
      self.blocks = nnx.List([Block(rngs) for _ in range(2)])
      self.ln = nnx.LayerNorm(d, rngs=rngs)
      self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
      x = self.embed(tokens) + self.pos[...][None, :tokens.shape[1]]
      mask = nnx.make_causal_mask(tokens)
      for b in self.blocks:
        x = b(x, mask)
      return self.head(self.ln(x))

  def nnx_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]).mean()

  mesh = jax.make_mesh((jax.device_count(),), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  rep, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  rng = np.random.default_rng(0)
  batches = [jax.device_put(jnp.asarray(
      rng.integers(0, vocab, (batch, context + 1)), jnp.int32), shard)
             for _ in range(4)]
  adam = optax.adam(1e-3)
  chain = optax.chain(jaxcomp.compressed_mean("identity", "data"), adam)

  # The functional route: the model's parameters as a pytree.
  graphdef, params0 = nnx.split(GPT(nnx.Rngs(0)))
  n_params = sum(x.size for x in jax.tree.leaves(params0))

  def loss_fn(params, tokens):
    return nnx_loss(nnx.merge(graphdef, params), tokens)

  @jax.jit
  def plain_step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = adam.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  plain = [jax.device_put(params0, rep), None]
  plain[1] = jax.device_put(adam.init(plain[0]), rep)
  comp = [jaxcomp.init(chain, params0, mesh)]
  comp_step = jaxcomp.make_train_step(loss_fn, chain, mesh=mesh)

  # The NNX route.
  m_plain = GPT(nnx.Rngs(0))
  o_plain = nnx.Optimizer(m_plain, adam, wrt=nnx.Param)

  @nnx.jit
  def nnx_step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(nnx_loss)(model, tokens)
    optimizer.update(model, grads)
    return loss

  m_comp = GPT(nnx.Rngs(0))
  o_comp = jaxcomp.flax.Optimizer(m_comp, chain, wrt=nnx.Param, mesh=mesh)
  jc_step = jaxcomp.flax.train_step(nnx_loss)

  def run_plain(t):
    plain[0], plain[1], loss = plain_step(plain[0], plain[1], t)
    return float(loss)

  def run_comp(t):
    comp[0], loss = comp_step(comp[0], t)
    return float(loss)

  runs = {"jit": run_plain, "jit_identity": run_comp,
          "nnx": lambda t: float(nnx_step(m_plain, o_plain, t)),
          "nnx_identity": lambda t: float(jc_step(m_comp, o_comp, t))}
  for f in runs.values():  # compile and warm up
    for t in batches[:2]:
      f(t)
  times = {k: [] for k in runs}
  per = max(1, args.steps // args.rounds)
  for r in range(args.rounds):
    for k, f in runs.items():
      for s in range(per):
        t = batches[(r + s) % len(batches)]
        t0 = time.perf_counter()
        f(t)
        times[k].append(time.perf_counter() - t0)
  med = {k: statistics.median(v) for k, v in times.items()}
  ops = lambda c: sorted((o.kind, o.operand_bytes)
                         for o in jaxcomp.collective_traffic(c).ops)
  plain_ops = ops(plain_step.lower(plain[0], plain[1], batches[0]).compile())
  comp_ops = ops(comp_step.lower(comp[0], batches[0]).compile())
  return {"devices": jax.device_count(), "params": int(n_params),
          "median_ms": {k: 1e3 * v for k, v in med.items()},
          "jit_ratio": med["jit_identity"] / med["jit"],
          "nnx_ratio": med["nnx_identity"] / med["nnx"],
          "same_collectives": plain_ops == comp_ops,
          "plain_collectives": len(plain_ops), "jaxcomp_collectives": len(comp_ops)}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--devices", type=int, nargs="+", default=[1, 8])
  ap.add_argument("--steps", type=int, default=120, help="timed steps per step kind")
  ap.add_argument("--rounds", type=int, default=12)
  ap.add_argument("--json", help="also write the results here")
  ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    print(json.dumps(_worker(args)))
    return 0
  rows = []
  for n in args.devices:
    out = subprocess.run(
        [sys.executable, __file__, "--worker", str(n), "--steps",
         str(args.steps), "--rounds", str(args.rounds)],
        capture_output=True, text=True, check=True)
    rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
  print(f"NNX GPT, {rows[0]['params']} parameters, Adam; medians of "
        f"{args.steps} interleaved steps")
  print(f"{'devices':>7}  {'jit ms':>7}  {'+identity':>9}  {'ratio':>6}  "
        f"{'nnx ms':>7}  {'+identity':>9}  {'ratio':>6}  same collectives")
  for r in rows:
    m = r["median_ms"]
    print(f"{r['devices']:>7}  {m['jit']:>7.2f}  {m['jit_identity']:>9.2f}  "
          f"{r['jit_ratio']:>6.3f}  {m['nnx']:>7.2f}  {m['nnx_identity']:>9.2f}  "
          f"{r['nnx_ratio']:>6.3f}  {r['same_collectives']} "
          f"({r['jaxcomp_collectives']} vs {r['plain_collectives']})")
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(rows, fh, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())

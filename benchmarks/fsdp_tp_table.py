"""The jax.jit step over FSDP x tensor-parallel parameters (MaxText's
default mesh: data, fsdp, tensor), compressed and plain, read from the
compiled modules: per-device flops, argument and temporary bytes, and the
bytes of each collective kind with its replica group size; plus the loss of
the identity transform against the plain GSPMD step over a few steps.

  python benchmarks/fsdp_tp_table.py [--meshes 2,2,2 1,4,2] [--steps 3]

Runs on 8 simulated CPU devices; prints a Markdown table per mesh (the one
in docs/fsdp_results.md).
"""

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import numpy as np
import optax

import jaxcomp

D, H, BATCH = 512, 2048, 64
DATA = ("data", "fsdp")
# A transformer block's MLP as MaxText shards it: the embedding dimension
# over fsdp, the hidden one over tensor; a norm scale over fsdp, a bias
# replicated.
SPECS = {"wi": P("fsdp", "tensor"), "wo": P("tensor", "fsdp"),
         "scale": P("fsdp"), "bias": P()}


def params_on(mesh):
  rng = np.random.default_rng(0)
  host = {"wi": rng.normal(size=(D, H)) / np.sqrt(D),
          "wo": rng.normal(size=(H, D)) / np.sqrt(H),
          "scale": np.ones(D), "bias": np.zeros(D)}
  return {k: jax.device_put(jnp.asarray(v, jnp.float32),
                            NamedSharding(mesh, SPECS[k]))
          for k, v in host.items()}


def loss_fn(p, batch):
  x, y = batch
  h = jax.nn.gelu((x * p["scale"][None]) @ p["wi"])
  return jnp.mean((h @ p["wo"] + p["bias"][None] - y) ** 2)


def batch_on(mesh, seed):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(BATCH, D)), jnp.float32)
  return jax.device_put((x, jnp.tanh(x)), NamedSharding(mesh, P(DATA)))


OPTIMIZER = optax.adam(1e-3)


@jax.jit
def plain_step(params, opt_state, batch):
  loss, grads = jax.value_and_grad(loss_fn)(params, batch)
  updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def compressed_step(grad_fn):
  @jax.jit
  def step(params, opt_state, comp_state, batch):
    (loss, grads), comp_state = grad_fn(params, comp_state, batch)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, comp_state, loss
  return step


def axes_of(mesh, group) -> str:
  """The mesh axes a replica group spans (those its devices differ in)."""
  coords = {d.id: c for c, d in np.ndenumerate(mesh.devices)}
  at = [coords[i] for i in group]
  names = [a for k, a in enumerate(mesh.axis_names)
           if len({c[k] for c in at}) > 1]
  return "+".join(names) or "none"


def row(name, compiled, mesh):
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, list) else ca
  mem = compiled.memory_analysis()
  kinds = {}
  for op in jaxcomp.collective_traffic(compiled).ops:
    key = (op.kind, axes_of(mesh, op.replica_groups[0]) if op.replica_groups
           else "all")
    kinds[key] = kinds.get(key, 0) + op.operand_bytes
  coll = ", ".join(f"{k} over {g}: {b:,}" for (k, g), b in sorted(kinds.items()))
  return (f"| {name} | {ca['flops']:,.0f} | {mem.argument_size_in_bytes:,} | "
          f"{mem.temp_size_in_bytes:,} | {coll} |")


def table(shape, steps):
  mesh = jax.make_mesh(shape, ("data", "fsdp", "tensor"),
                       axis_types=(AxisType.Auto,) * 3)
  params, batch = params_on(mesh), batch_on(mesh, 0)
  opt_state = OPTIMIZER.init(params)
  lines = [f"Mesh data {shape[0]} x fsdp {shape[1]} x tensor {shape[2]}:", "",
           "| step | flops / device | argument bytes | temporary bytes | "
           "collective operand bytes / device, by kind and mesh axes |",
           "| --- | --- | --- | --- | --- |",
           row("plain GSPMD", plain_step.lower(params, opt_state, batch).compile(), mesh)]
  losses = {}
  for name, kw in (("identity", {}), ("int8_block", {})):
    grad_fn = jaxcomp.compressed_value_and_grad(
        loss_fn, jaxcomp.compressed_mean(name, DATA, **kw), mesh, axis_name=DATA)
    comp_state = grad_fn.init(params)
    step = compressed_step(grad_fn)
    lines.append(row(f"`{name}`", step.lower(params, opt_state, comp_state,
                                             batch).compile(), mesh))
    p, o, c = params, opt_state, comp_state
    losses[name] = []
    for i in range(steps):
      p, o, c, loss = step(p, o, c, batch_on(mesh, i))
      losses[name].append(float(loss))
  p, o = params, opt_state
  losses["plain"] = []
  for i in range(steps):
    p, o, loss = plain_step(p, o, batch_on(mesh, i))
    losses["plain"].append(float(loss))
  rel = max(abs(a - b) / abs(b) for a, b in zip(losses["identity"], losses["plain"]))
  lines += ["", f"Loss over {steps} steps: plain {losses['plain']}, identity "
            f"{losses['identity']} (largest relative difference {rel:.1e}), "
            f"int8 blocks {losses['int8_block']}."]
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--meshes", nargs="+", default=["2,2,2", "1,4,2"])
  parser.add_argument("--steps", type=int, default=3)
  args = parser.parse_args()
  with jax.numpy_dtype_promotion("standard"):
    for m in args.meshes:
      print(table(tuple(int(x) for x in m.split(",")), args.steps))
      print()


if __name__ == "__main__":
  main()

"""Memory passes of each compressor's XLA encode and decode, from the
compiled module (no timing): what the structural model says each costs.

For a flat float32 buffer of ``--n`` elements, compiles ``encode(x, key)``
and ``decode(payload, n, key)`` on the default backend and counts, with
:func:`jaxcomp.hlo.traffic.memory_passes`, the bytes of buffers of at least ``n / 4``
elements read and written, in passes of ``4 n`` bytes. Conditional branches
(fallbacks most steps skip) are shown apart. Also prints whether any
``jax.random`` draw is gradient-sized, and the operations per grid block
inside each Pallas kernel (:func:`jaxcomp.hlo.kernel_structure.kernel_ops`, a
proxy for its compute)::

  python benchmarks/codec_passes.py
  python benchmarks/codec_passes.py --n 1863690 --specs topk:ratio=0.01 qsgd
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_SPECS = ["identity", "bf16", "topk:ratio=0.01", "dgc:ratio=0.01",
                 "threshold", "random_k:ratio=0.01", "random_block:ratio=0.01",
                 "qsgd", "terngrad", "sign", "int8_block",
                 "int8_block:rounding=stochastic", "int8_block:bits=4",
                 "fp8_block", "fp8_block:rounding=stochastic"]


def _random_sizes(jaxpr):
  import jax.extend.core
  for eqn in jaxpr.eqns:
    if "random" in eqn.primitive.name or "threefry" in eqn.primitive.name:
      yield from (v.aval.size for v in eqn.outvars)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _random_sizes(sub)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--n", type=int, default=1863690,
                  help="buffer elements (default: the MLP of "
                       "benchmarks/transform_overhead.py)")
  ap.add_argument("--specs", nargs="+", default=DEFAULT_SPECS)
  ap.add_argument("--no-kernels", action="store_true",
                  help="leave out the Pallas kernels' operation counts")
  args = ap.parse_args(argv)
  sys.path.insert(0, REPO)
  import jax
  import jax.numpy as jnp

  from jaxcomp.hlo import traffic as hlo
  from jaxcomp.cli import parse_compressor_spec
  from jaxcomp.compressors.base import get

  n = args.n
  x = jnp.ones((n,), jnp.float32)
  key = jax.random.key(0)
  print(f"{jax.default_backend()}, n = {n} float32; passes of 4 n bytes "
        "(read + write), [in branches]; largest jax.random draw")
  print(f"{'compressor':<32}{'encode':>16}{'decode':>16}{'random':>10}")
  for spec in args.specs:
    name, kw = parse_compressor_spec(spec)
    comp = get(name, **kw)
    if getattr(comp, "own_exchange", False) and name != "terngrad":
      print(f"{spec:<32}{'(own exchange)':>32}")
      continue
    enc = jax.jit(lambda v, k: comp.encode(v, k))
    payload = enc(x, key)
    dec = jax.jit(lambda p, k: comp.decode(p, n, k))
    cells = []
    for f, a in ((enc, (x, key)), (dec, (payload, key))):
      mp = hlo.memory_passes(f.lower(*a).compile(), n // 4)
      cells.append(f"{mp.passes(4 * n):5.2f} [{mp.branch_passes(4 * n):5.2f}]")
    draws = list(_random_sizes(jax.make_jaxpr(enc)(x, key).jaxpr))
    print(f"{spec:<32}{cells[0]:>16}{cells[1]:>16}{max(draws, default=0):>10}")
  if not args.no_kernels:
    _kernel_ops(n)
  return 0


def _kernel_ops(n: int) -> None:
  """The Pallas kernels' operations per grid block (their bodies' jaxprs,
  traced in interpret mode): the compute proxy of the structural model."""
  import jax
  import jax.numpy as jnp
  from jaxcomp.kernels import QuantizeConfig, int8_block, qsgd, sign, topk
  from jaxcomp.hlo import kernel_structure as structure
  x = jax.ShapeDtypeStruct((n,), jnp.float32)
  seed = jax.ShapeDtypeStruct((2,), jnp.uint32)
  cfg = QuantizeConfig()
  kernels = {
      "sign_pack": (lambda v: sign.sign_pack(v, config=cfg, interpret=True), (x,)),
      "qsgd levels 7, bucket 128": (lambda v, s: qsgd.qsgd_quantize(
          v, levels=7, bucket_size=128, seed=s, config=cfg, interpret=True), (x, seed)),
      "int8 block 256": (lambda v: int8_block.int8_block_quantize(
          v, block_size=256, config=cfg, interpret=True), (x,)),
      "int8 block 256 stochastic": (lambda v, s: int8_block.int8_block_quantize(
          v, block_size=256, seed=s, config=cfg, interpret=True), (x, seed)),
      "top-k 1% (mask pass)": (lambda v: topk.topk(v, max(1, n // 100), interpret=True),
                               (x,)),
  }
  print("\nPallas kernels, operations per grid block (interpret-mode jaxpr): "
        "ops, element-ops, input elements per block, element-ops per input element")
  for name, (f, a) in kernels.items():
    for k in structure.kernel_ops(f, *a):
      print(f"{name:<28}{k.name + (' [branch]' if k.in_branch else ''):<28}{k.ops:>6}"
            f"{k.element_ops:>10}{k.block_input_elements:>8}{k.per_input_element:>8.1f}")


if __name__ == "__main__":
  sys.exit(main())

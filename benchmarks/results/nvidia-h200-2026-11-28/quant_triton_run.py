"""int8 / fp8 blocks: the Triton-lowered one-pass prototype (.gpu/tri.py)
against the XLA reference and the Mosaic GPU kernel, same inputs, same timer."""
import sys, os, json
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np
import jax, jax.numpy as jnp
from jaxcomp.bench.kernels import time_calls
from jaxcomp.kernels import int8_block, fp8_block
import tri

out = sys.argv[1]
sizes = [int(float(s)) for s in sys.argv[2].split(",")]
gpu = jax.default_backend() == "gpu"
rows = []
def save():
  json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows), open(out, "w"), indent=1)
for n in sizes:
  for dt in (jnp.float32, jnp.bfloat16):
    copies = max(4, min(16, -(-int(4e8) // (n * 4))))
    xs = [jax.random.normal(jax.random.key(i), (n,), jnp.float32).astype(dt) for i in range(copies)]
    jax.block_until_ready(xs)
    cands = {"copy x*2": lambda x: x * 2,
             "int8 xla": lambda x: int8_block.int8_block_quantize_reference(x, block_size=256),
             "int8 mosaic": lambda x: int8_block.int8_block_quantize(x, block_size=256)}
    for r_ in (8, 32):
      for w in (4, 8):
        cands[f"int8 triton r{r_} w{w}"] = (lambda r_, w: lambda x: tri.quantize(x, rows=r_, num_warps=w, interpret=not gpu))(r_, w)
    cands["fp8 xla"] = lambda x: fp8_block.fp8_block_quantize_reference(x, block_size=256)
    cands["fp8 triton r8 w4"] = lambda x: tri.quantize(x, rows=8, num_warps=4, fmt="fp8", interpret=not gpu)
    ref = {"int8": jax.jit(cands["int8 xla"])(xs[0]), "fp8": jax.jit(cands["fp8 xla"])(xs[0])}
    for name, fn in cands.items():
      try:
        same = None
        if "triton" in name or "mosaic" in name:
          q, s = jax.jit(fn)(xs[0]); qr, sr = ref[name.split()[0]]
          same = bool(np.array_equal(np.asarray(s), np.asarray(sr)) and np.array_equal(
              np.asarray(q).view(np.uint8), np.asarray(qr).view(np.uint8)))
        sec = time_calls(fn, xs, repeats=7, calls=3, unrolled=True)
        gbs = n * jnp.dtype(dt).itemsize * (2 if name.startswith("copy") else 1) / sec / 1e9
        rows.append(dict(n=n, dtype=jnp.dtype(dt).name, path=name, ms=sec * 1e3, same=same))
        print(f"{n:>12,} {jnp.dtype(dt).name:<9} {name:<20} {sec*1e3:8.3f} ms  read {gbs:7.1f} GB/s  same={same}", flush=True)
      except Exception as e:  # noqa
        print(f"{n:>12,} {jnp.dtype(dt).name:<9} {name:<20} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
      save()
    del xs

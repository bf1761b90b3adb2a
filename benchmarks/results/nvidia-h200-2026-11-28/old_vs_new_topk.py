"""Top-k XLA fast path: 836b63f's topk_threshold_xla (as measured on the
H100 on 2026-11-23) against today's, selection sort and partial, in one
process, same inputs, same timer (jaxcomp.bench.kernels.time_calls)."""
import sys, os, json, statistics
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax, jax.numpy as jnp
from jaxcomp.bench.kernels import time_calls
from jaxcomp.kernels import topk as new
from oldk import topk as old

rows = []
for n in (int(1e6), int(2.5e7), int(1e8)):
  copies = 4 if n >= 2.5e7 else 16
  xs = [jax.random.normal(jax.random.key(i), (n,), jnp.float32) for i in range(copies)]
  k = n // 100
  cands = {
      "lax.top_k": lambda x: jax.lax.top_k(jnp.abs(x), k),
      "old_836b63f": lambda x: old.topk_threshold_xla(x, k),
      "new_sort": lambda x: new.topk_threshold_xla(x, k, config=new.TopKConfig(selection="sort")),
      "new_partial": lambda x: new.topk_threshold_xla(x, k, config=new.TopKConfig(selection="partial")),
  }
  ref = None
  for name, fn in cands.items():
    try:
      out = jax.jit(fn)(xs[0])
      if name != "lax.top_k":
        idx = jnp.sort(out[1])
        if ref is None: ref = idx
        same = bool(jnp.array_equal(idx, ref))
      else:
        same = None
      s = time_calls(fn, xs, repeats=7, calls=3, unrolled=True)
      rows.append(dict(n=n, path=name, ms=s * 1e3, same_as_old=same))
      print(f"{n:>12,} {name:<14} {s*1e3:8.3f} ms same={same}", flush=True)
    except Exception as e:  # noqa
      print(f"{n:>12,} {name:<14} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
  del xs
json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows),
          open(sys.argv[1], "w"), indent=1)

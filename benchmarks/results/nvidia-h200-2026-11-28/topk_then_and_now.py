"""Top-k 1% at one size: 836b63f's XLA fast path, today's (sort, partial),
lax.top_k and torch.topk, same process."""
import sys, os, json
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax, jax.numpy as jnp
from jaxcomp.bench.kernels import time_calls
from jaxcomp.kernels import topk as new
from oldk import topk as old
out = sys.argv[1]; n = int(float(sys.argv[2])); k = n // 100
xs = [jax.random.normal(jax.random.key(i), (n,), jnp.float32) for i in range(4)]
rows = []
cands = {"lax.top_k": lambda x: jax.lax.top_k(jnp.abs(x), k),
         "old_836b63f": jax.jit(lambda x: old.topk_threshold_xla(x, k)),
         "new_sort": jax.jit(lambda x: new.topk_threshold_xla(x, k, config=new.TopKConfig(selection="sort"))),
         "new_partial": jax.jit(lambda x: new.topk_threshold_xla(x, k, config=new.TopKConfig(selection="partial")))}
cands["lax.top_k"] = jax.jit(cands["lax.top_k"])
for name, fn in cands.items():
  try:
    s = time_calls(fn, xs, repeats=7, calls=8)
    rows.append(dict(n=n, path=name, ms=s * 1e3)); print(f"{n:>12,} {name:<12} {s*1e3:8.3f} ms", flush=True)
  except Exception as e:  # noqa
    print(name, "FAILED", type(e).__name__, str(e)[:200], flush=True)
  json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows), open(out, "w"), indent=1)
try:
  import torch
  ts = [torch.randn(n, device="cuda") for _ in range(4)]
  for t in ts: torch.topk(t.abs(), k)
  torch.cuda.synchronize()
  import time, statistics
  per = []
  for _ in range(7):
    a = time.perf_counter()
    for i in range(8): torch.topk(ts[i % 4].abs(), k)
    torch.cuda.synchronize(); per.append((time.perf_counter() - a) / 8)
  s = statistics.median(per); rows.append(dict(n=n, path="torch.topk", ms=s * 1e3)); print(f"{n:>12,} torch.topk   {s*1e3:8.3f} ms")
except Exception as e:  # noqa
  print("torch FAILED", type(e).__name__, str(e)[:200])
json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows), open(out, "w"), indent=1)

"""Prototype: int8 / fp8 block quantization as a Pallas kernel lowered by
Triton, one pass over x with masked loads (no padded copy)."""
import functools
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def _kernel(x_ref, q_ref, s_ref, *, n, block, rows, fmt):
  pid = pl.program_id(0)
  span = rows * block
  start = pid * span
  offs = start + jnp.arange(span, dtype=jnp.int32)
  x = plt.load(x_ref.at[pl.ds(start, span)], mask=offs < n, other=0)
  x = x.astype(jnp.float32).reshape(rows, block)
  top = 127.0 if fmt == "int8" else 448.0
  scale = jnp.max(jnp.abs(x), axis=1) / jnp.float32(top)
  safe = jnp.where(scale > 0, scale, jnp.float32(1))
  m = jnp.where(scale > 0, jnp.float32(1) / safe, jnp.float32(0))
  y = x * m[:, None]
  if fmt == "int8":
    # Round half to even from the floor (Triton lowers no lax.round): y -
    # floor(y) is exact for |y| < 2**23.
    f = jnp.floor(y)
    d = y - f
    fi = f.astype(jnp.int32)
    up = (d > 0.5) | ((d == 0.5) & ((fi & 1) == 1))
    r = fi + up.astype(jnp.int32)
    q = jnp.clip(r, -127, 127).astype(jnp.int8)
  else:
    q = y.astype(jnp.float8_e4m3fn)
  nb = -(-n // block)
  plt.store(q_ref.at[pl.ds(start, span)], q.reshape(span),
            mask=offs < (nb * block if fmt == "int8" else n))
  b = pid * rows + jnp.arange(rows, dtype=jnp.int32)
  plt.store(s_ref.at[pl.ds(pid * rows, rows)], scale, mask=b < nb)


@functools.partial(jax.jit, static_argnames=("block", "rows", "fmt", "num_warps", "interpret"))
def quantize(x, *, block=256, rows=16, fmt="int8", num_warps=4, interpret=False):
  flat = x.reshape(-1)
  n = flat.shape[0]
  nb = -(-n // block)
  grid = -(-nb // rows)
  qdt = jnp.int8 if fmt == "int8" else jnp.float8_e4m3fn
  qlen = nb * block if fmt == "int8" else n
  return pl.pallas_call(
      functools.partial(_kernel, n=n, block=block, rows=rows, fmt=fmt),
      out_shape=(jax.ShapeDtypeStruct((qlen,), qdt),
                 jax.ShapeDtypeStruct((nb,), jnp.float32)),
      grid=(grid,),
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name=f"jaxcomp_{fmt}_triton")(flat)

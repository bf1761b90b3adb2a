"""Bugs of JAX releases the suite works around, each with its reproducer,
run in a subprocess (a crash there fails one test, not the run). A strict
xfail on the affected releases says when a release fixes one, so that the
workaround can go."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ZERO_SIZE_ARGS_CRASH

ZERO_SIZE_SHARD_MAP = """
import jax, jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((8,), ("data",))
def body(g, c):  # no jaxcomp: a zero-size argument and one psum
  return c + lax.psum(jnp.sum(g), "data").astype(jnp.int32)
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()),
                          out_specs=P()))
x = jax.device_put(jnp.zeros((8, 0)), NamedSharding(mesh, P("data")))
print(int(f(x, jnp.int32(3))))
"""


@pytest.mark.xfail(ZERO_SIZE_ARGS_CRASH, strict=True,
                   reason="JAX 0.11's XLA segfaults compiling it")
def test_shard_map_with_a_zero_size_argument_and_a_psum_compiles():
  """helpers.ZERO_SIZE_ARGS_CRASH: the sum of a zero-size shard is 0 on
  every device, so the psum adds 0."""
  env = {**os.environ,
         "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
         "JAX_PLATFORMS": "cpu"}
  r = subprocess.run([sys.executable, "-c", ZERO_SIZE_SHARD_MAP], env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
  assert r.stdout.strip() == "3"

"""Test configuration: 8 simulated CPU devices and strict numerics.

Strict dtype promotion and rank promotion catch silent dtype bugs, which
matter for quantization (Equinox's habit).
"""

import os

# Simulated devices are threads; on a loaded 2-core machine one can arrive
# at a collective much later than the others, so XLA's default 40 s
# rendezvous abort is raised.
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 "
    "--xla_cpu_collective_call_terminate_timeout_seconds=900 "
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=300")

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def mesh8():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS was set before jax was imported)")
  return jax.make_mesh((8,), ("data",))

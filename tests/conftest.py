"""Test configuration: 8 simulated CPU devices and strict numerics.

Strict dtype promotion and rank promotion catch silent dtype bugs, which
matter for quantization (Equinox's habit).
"""


from examples import xla_flags  # noqa: E402  (imports no jax)

xla_flags.set_cpu_devices(8)

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def mesh8():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS was set before jax was imported)")
  return jax.make_mesh((8,), ("data",))


@pytest.fixture(scope="session")
def mesh_all():
  """A 1-D ``data`` mesh over every device of the backend (8 simulated CPU
  devices here, the GPUs on a GPU machine)."""
  return jax.make_mesh((jax.device_count(),), ("data",))

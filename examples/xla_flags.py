"""XLA flags for simulated CPU devices, shared by the examples, benchmarks
and tests. Import this before jax (it imports nothing itself).

Simulated devices are threads of one process. On a busy 2-core machine:

* one device may reach a collective long after the others, past XLA's
  default 40 s rendezvous abort, so the abort is raised to 900 s;
* Eigen's intra-op thread pool, shared by all simulated devices, was seen
  to starve the device threads of a pending all-reduce for minutes; with
  ``--xla_cpu_multi_thread_eigen=false`` each device computes on its own
  thread (8 devices already keep 2 cores busy).
"""

import os


def cpu_device_flags(devices: int) -> str:
  """The XLA_FLAGS value for ``devices`` simulated CPU devices."""
  return (f"--xla_force_host_platform_device_count={devices} "
          "--xla_cpu_multi_thread_eigen=false "
          "--xla_cpu_collective_call_terminate_timeout_seconds=900 "
          "--xla_cpu_collective_call_warn_stuck_timeout_seconds=300")


def set_cpu_devices(devices: int) -> None:
  """Sets XLA_FLAGS for ``devices`` simulated CPU devices unless the caller
  already set XLA_FLAGS. Has no effect once jax has started a backend."""
  os.environ.setdefault("XLA_FLAGS", cpu_device_flags(devices))

"""Test configuration: 8 simulated CPU devices, strict numerics, and the
Hypothesis profiles of the property tests.

Strict dtype promotion and rank promotion catch silent dtype bugs, which
matter for quantization (Equinox's habit).

Hypothesis profiles (``tests/test_properties_*.py``): ``ci``, the default, a
bounded and derandomized run (the same inputs every time, within the CI
budget); ``thorough``, 20x the inputs, drawn afresh, for a run by hand::

  JAXCOMP_HYPOTHESIS_PROFILE=thorough python -m pytest -q -n 2 \\
      tests/test_properties_config.py tests/test_properties_numeric.py \\
      tests/test_properties_checkpoint.py

(or ``--hypothesis-profile thorough``). The number of inputs tried is
printed at the end of the run (``hypothesis: N inputs tried``).
"""

import os

from examples import xla_flags  # noqa: E402  (imports no jax)

xla_flags.set_cpu_devices(8)

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# deadline=None: an input's first run compiles (seconds), the next ones do
# not, which Hypothesis would report as flaky timing.
_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow,
                                      HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=60, derandomize=True,
                          database=None, **_COMMON)
settings.register_profile("thorough", max_examples=1200, **_COMMON)
settings.load_profile(os.environ.get("JAXCOMP_HYPOTHESIS_PROFILE", "ci"))

_INPUTS = "hypothesis_inputs"


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_call(item):
  """Counts the inputs each Hypothesis test ran (passing or failing; not
  the ones its strategies rejected), from Hypothesis's run statistics, into
  the test report (``user_properties``, which also travel back from xdist
  workers)."""
  try:
    from hypothesis.statistics import collector
  except ImportError:  # another Hypothesis: no count, nothing else changes
    yield
    return
  outer = collector.value

  def note(stats):
    tried = sum(1 for key, phase in stats.items()
                if key.endswith("-phase") and isinstance(phase, dict)
                for case in phase.get("test-cases", ())
                if case.get("status") in ("valid", "interesting"))
    item.user_properties.append((_INPUTS, tried))
    if outer is not None:
      outer(stats)

  with collector.with_value(note):
    yield


_XDIST_WORKER = False  # set in pytest_configure: a pytest-xdist worker


def pytest_configure(config):
  # Read from the config, not PYTEST_XDIST_WORKER: a test that starts pytest
  # in a subprocess (the device check) passes that variable on.
  global _XDIST_WORKER
  _XDIST_WORKER = hasattr(config, "workerinput")


def pytest_runtest_logreport(report):
  """With ``JAXCOMP_TEST_PROGRESS`` set to a file (``python
  benchmarks/device_check.py`` sets it), each test's outcome and seconds are appended as
  it finishes, and a failure's traceback at once: a run stopped at its time
  limit still says what failed and where the time went (pytest prints
  failures and durations only at the end). Under pytest-xdist the
  controller writes it, from the reports its workers send."""
  path = os.environ.get("JAXCOMP_TEST_PROGRESS")
  if _XDIST_WORKER:
    return
  if not path or (report.when != "call" and not report.failed):
    return
  with open(path, "a", encoding="utf-8") as f:
    f.write(f"{report.outcome} {report.duration:.1f}s {report.when} "
            f"{report.nodeid}\n")
    if report.failed:
      f.write(report.longreprtext + "\n\n")


def pytest_terminal_summary(terminalreporter):
  tests, tried = 0, 0
  for reports in terminalreporter.stats.values():
    for report in reports:
      if getattr(report, "when", None) != "call":
        continue
      for key, value in getattr(report, "user_properties", ()):
        if key == _INPUTS:
          tests += 1
          tried += value
  if tests:
    terminalreporter.write_line(
        f"hypothesis (profile {settings.get_current_profile_name()}): "
        f"{tried} inputs "
        f"tried by {tests} property tests")


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

"""Every ``>>>`` example in the docstrings of jaxcomp and its kernels runs
and prints what it says (on the 8 simulated CPU devices of conftest)."""

import doctest
import importlib
import pkgutil

import pytest

import jaxcomp


def _modules():
  names = ["jaxcomp"]
  for info in pkgutil.walk_packages(jaxcomp.__path__, "jaxcomp."):
    if info.name.endswith("__main__"):  # entry points run on import
      continue
    names.append(info.name)
  return names


def _examples(name):
  module = importlib.import_module(name)
  return [t for t in doctest.DocTestFinder().find(module, name)
          if t.examples and getattr(t, "filename", "") and
          t.filename.endswith(".py")]


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples_run(name):
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS
                                 | doctest.NORMALIZE_WHITESPACE)
  for test in _examples(name):
    runner.run(test)
  result = runner.summarize(verbose=False)
  assert result.failed == 0, f"{result.failed} docstring examples of {name} failed"


def test_the_public_entry_points_have_examples():
  """The transform and its helpers show how they are called."""
  import jaxcomp.transform
  import jaxcomp.wire
  for fn in (jaxcomp.transform.compressed_mean, jaxcomp.init,
             jaxcomp.make_train_step, jaxcomp.wire.ring_bytes,
             jaxcomp.compressors.get):
    assert ">>>" in (fn.__doc__ or ""), fn.__qualname__


# Names of jaxcomp.__all__ whose docstring has no example yet, and why.
_NO_EXAMPLE_YET: dict[str, str] = {}


def test_every_top_level_name_has_an_example_that_runs():
  """A name of ``jaxcomp.__all__`` shows how it is called, in a ``>>>``
  example that test_docstring_examples_run collects (from the module that
  defines it)."""
  collected = {t.name for name in _modules() for t in _examples(name)}
  missing = []
  for name in jaxcomp.__all__:
    obj = getattr(jaxcomp, name)
    where = f"{obj.__module__}.{obj.__qualname__}"
    if name in _NO_EXAMPLE_YET:
      continue
    if ">>>" not in (obj.__doc__ or "") or where not in collected:
      missing.append(where)
  assert not missing, missing
  for name in _NO_EXAMPLE_YET:  # an example there ends its exception here
    assert ">>>" not in (getattr(jaxcomp, name).__doc__ or ""), (
        f"{name} has an example now: drop it from _NO_EXAMPLE_YET")

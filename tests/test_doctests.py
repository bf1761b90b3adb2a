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
    if not info.name.endswith("__main__"):  # entry points run on import
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
  for fn in (jaxcomp.transform.compressed_mean, jaxcomp.init_sharded,
             jaxcomp.make_train_step, jaxcomp.wire.ring_bytes,
             jaxcomp.compressors.get):
    assert ">>>" in (fn.__doc__ or ""), fn.__qualname__

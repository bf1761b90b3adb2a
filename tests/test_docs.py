"""The code in docs/design.md runs as written: the worked example of adding
a compressor registers, trains through compressed_mean and is unbiased."""

import pathlib
import re
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]


def python_blocks(path):
  return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def test_design_doc_example_compressor_works_in_compressed_mean():
  blocks = python_blocks(ROOT / "docs" / "design.md")
  assert len(blocks) == 2, "docs/design.md: the compressor and its test"
  script = "\n".join([
      "from examples import xla_flags",
      "xla_flags.set_cpu_devices(8)",
      *blocks,
      textwrap.dedent("""
      import jaxcomp
      from tests.helpers import run_shard_map
      g = {"w": jax.random.normal(jax.random.key(2), (8, 300))}
      tx = jaxcomp.compressed_mean("natural_doc_example", "data")
      mesh = jax.make_mesh((8,), ("data",))
      u, ref, state, _ = run_shard_map(tx, g, mesh)
      assert float(jaxcomp.get_stats(state).bytes_sent) == 2 * 300
      # Each device's value is within a factor of two of its gradient, so
      # the mean is too, entry by entry where the signs agree.
      assert jax.numpy.isfinite(u["w"]).all()
      assert state.feedback == ((),)  # unbiased: no error feedback
      print("ok")
      """)])
  out = subprocess.run([sys.executable, "-c", script], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip().endswith("ok")

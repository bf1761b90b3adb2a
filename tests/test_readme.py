"""The README's set-up commands are the ones CI runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _setup_commands():
  text = (ROOT / "README.md").read_text()
  block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
  return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_two_setup_commands():
  text = (ROOT / "README.md").read_text()
  first_block = text.index("```bash")
  assert "```" not in text[:first_block]  # the commands come first
  commands = _setup_commands()
  assert len(commands) == 2
  assert "examples.fashion_mnist.main" in commands[0]
  assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
  ci = (ROOT / ".ci" / "run").read_text()
  test_command = _setup_commands()[1].split("; ", 1)[1]
  assert test_command in ci.splitlines()


def test_readme_train_step_runs_as_written():
  """The README's train-step block, with a tiny model and a host batch
  filled in (as a user would), runs on 8 simulated devices and trains."""
  import os
  import subprocess
  import sys
  text = (ROOT / "README.md").read_text()
  section = text[text.index("## A train step"):]
  snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  script = "\n".join([
      "import os",
      "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'",
      "import numpy as np, jax.numpy as jnp",
      "rng = np.random.default_rng(0)",
      "params = {'w': jnp.zeros((16, 4)), 'b': jnp.zeros((4,))}",
      "batch = (rng.normal(size=(64, 16)).astype(np.float32),",
      "         rng.normal(size=(64, 4)).astype(np.float32))",
      "def loss_fn(params, batch):",
      "  x, y = batch",
      "  return jnp.mean((x @ params['w'] + params['b'] - y) ** 2)",
      snippet,
      "first = float(loss)",
      "for _ in range(20):",
      "  state, loss = train_step(state, batch)",
      "assert float(loss) < first, (first, float(loss))",
      "print('snippet ok')"])
  out = subprocess.run([sys.executable, "-c", script], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and "snippet ok" in out.stdout, out.stderr[-4000:]


def _anchor(heading: str) -> str:
  """A Markdown heading's anchor as GitHub and MyST write it: lower case,
  punctuation dropped, spaces as hyphens."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def test_readme_links_lead_to_pages_and_headings_that_exist():
  """Every link of the README into docs/ names a page that exists and,
  with ``#anchor``, a heading of that page (one click to the recipe)."""
  text = (ROOT / "README.md").read_text()
  links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", text)
  assert links
  for path, anchor in links:
    page = ROOT / path
    assert page.is_file(), path
    if anchor:
      headings = re.findall(r"^#{1,6} (.+)$", page.read_text(), re.M)
      assert anchor in {_anchor(h) for h in headings}, (path, anchor)
  gspmd = re.search(r"^\| a `jax.jit` step.*GSPMD.*$", text, re.M).group(0)
  assert "docs/sharded.md#gspmd-" in gspmd  # the GSPMD recipe itself

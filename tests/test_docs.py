"""The code in docs/design.md runs as written: the worked example of adding
a compressor registers, trains through compressed_mean and is unbiased."""

import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

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


# ------------------------------------------------------------- the guides ---
#
# The code of each guide runs as written. A page's blocks are fenced
#   ```python setup   the page's setup, run before each of its blocks
#   ```python         a block: run after the setup, in a fresh namespace
#   ```python prints  a block whose output is the code block after it
#   ```python norun   shown, not run (it needs what the page cannot give,
#                     e.g. a model of the reader's own)
# (MyST highlights all of them as Python.) docs/training_loop.md's recipes
# run in tests/test_training_loop.py, design.md's above.

GUIDES = ["index.md", "getting_started.md", "sharded.md", "lowcomm.md", "multihost.md",
          "perfmodel.md", "collectives.md", "optimizers.md"]
# Pages whose code other tests run: design.md above, training_loop.md's
# recipes in tests/test_training_loop.py.
RUN_ELSEWHERE = ["design.md", "training_loop.md"]

_FENCE = re.compile(r"^```(\S*)[ \t]*(.*?)\n(.*?)^```[ \t]*$", re.S | re.M)


def page_blocks(path):
  """``(setup, [(kind, code, expected output or None, line)])`` of a page."""
  text = path.read_text()
  fences = [(m.group(1), m.group(2).strip(), m.group(3),
             text.count("\n", 0, m.start()) + 1) for m in _FENCE.finditer(text)]
  setup, blocks = "", []
  for i, (lang, info, code, line) in enumerate(fences):
    if lang != "python":
      continue
    if info == "setup":
      setup += code
    elif info in ("", "prints", "norun"):
      expected = None
      if info == "prints":
        assert i + 1 < len(fences) and fences[i + 1][0] in ("", "text"), (
            f"{path.name}:{line}: a 'python prints' block needs its output "
            "in the code block after it")
        expected = fences[i + 1][2]
      blocks.append((info or "run", code, expected, line))
    else:
      raise AssertionError(f"{path.name}:{line}: unknown block kind {info!r}")
  return setup, blocks


_DRIVER = textwrap.dedent('''
    import contextlib, io, json, sys, traceback
    from examples import xla_flags
    xla_flags.set_cpu_devices(8)
    setup, blocks = json.load(sys.stdin)
    for code, expected, line in blocks:
      out = io.StringIO()
      try:
        with contextlib.redirect_stdout(out):
          namespace = {"__name__": "__main__"}
          exec(compile(setup, "<setup>", "exec"), namespace)
          exec(compile(code, f"<block at line {line}>", "exec"), namespace)
      except Exception:
        print(f"BLOCK FAILED at line {line}:", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
      if expected is not None:
        got = [l.rstrip() for l in out.getvalue().strip().splitlines()]
        want = [l.rstrip() for l in expected.strip().splitlines()]
        if got != want:
          print(f"BLOCK at line {line} printed:", *got, "the page says:", *want,
                sep="\\n", file=sys.stderr)
          sys.exit(1)
    print("blocks ok", len(blocks))
''')


@pytest.mark.parametrize("page", GUIDES)
def test_guide_code_runs_as_written(page):
  import json
  setup, blocks = page_blocks(ROOT / "docs" / page)
  run = [(code, expected, line) for kind, code, expected, line in blocks
         if kind != "norun"]
  assert run, f"docs/{page} has no code to run"
  out = subprocess.run([sys.executable, "-c", _DRIVER], cwd=ROOT,
                       input=json.dumps([setup, run]), capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, f"docs/{page}: " + out.stderr[-4000:]
  assert out.stdout.strip().endswith(f"blocks ok {len(run)}")


def test_which_compressor_page_shows_what_its_command_prints():
  """docs/which_compressor.md's rankings are `python
  docs/which_compressor.py`'s output (jaxcomp whatif, sorted), verbatim."""
  text = (ROOT / "docs" / "which_compressor.md").read_text()
  shown = re.search(r"```text\n(.*?)```", text, re.S).group(1)
  out = subprocess.run([sys.executable, "docs/which_compressor.py"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.rstrip() == shown.rstrip()
  # The three setups, each ranked, with dense among the rows.
  assert shown.count("$ jaxcomp whatif") == 6
  assert shown.count(" dense ") == 3


def test_every_python_block_of_the_docs_is_run_or_marked_norun():
  """A code block a reader may copy is run by a test, unless its fence
  says ``norun``."""
  unrun = []
  for path in sorted((ROOT / "docs").glob("*.md")):
    if path.name in RUN_ELSEWHERE:
      continue
    for m in _FENCE.finditer(path.read_text()):
      lang, info = m.group(1), m.group(2).strip()
      if lang == "python" and info != "norun" and path.name not in GUIDES:
        unrun.append(f"{path.name}: ```python {info}")
  assert not unrun, unrun


# ------------------------------------------------------- read in a browser ---

WIDTH = 100  # columns a code or output block shows without a scroll bar
# Lines of fenced blocks that are wider, by page: (a regex the line
# matches, why it cannot be wrapped).
WIDER = {
    "perfmodel.md": [
        (r"^(compressor|dense|bf16|topk:ratio=0\.01|random_block:ratio=0\.01"
         r"|qsgd:levels=16)\s{2,}",
         "`jaxcomp whatif --simulate`'s table (104 columns) as the command "
         "prints it, which has no width option; its rows cannot wrap"),
    ],
}

_OPEN = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")


def fenced_lines(text):
  """``(line number, info string, line)`` of every line inside a fenced
  block (backticks or tildes, indented or not) of a Markdown page; MyST
  directives (``{toctree}``, ...) are not code and are left out."""
  out, fence, info = [], None, ""
  for n, line in enumerate(text.splitlines(), 1):
    if fence is None:
      m = _OPEN.match(line)
      if m:
        fence, info = m.group(2), m.group(3).strip()
      continue
    stripped = line.strip()
    if stripped.startswith(fence[0] * len(fence)) and not stripped.strip(fence[0]):
      fence = None
      continue
    if not info.startswith("{"):
      out.append((n, info, line))
  return out


def test_no_code_or_output_block_of_the_docs_is_wider_than_the_page():
  """Every fenced block of docs/*.md fits 100 columns (the site shows
  about that much of a block before it scrolls), but for the lines WIDER
  names with the reason."""
  wide = []
  for path in sorted((ROOT / "docs").glob("*.md")):
    allowed = [re.compile(r) for r, _ in WIDER.get(path.name, ())]
    for n, _, line in fenced_lines(path.read_text()):
      if len(line) > WIDTH and not any(r.match(line) for r in allowed):
        wide.append(f"{path.name}:{n} ({len(line)} columns): {line[:60]}")
  assert not wide, "\n".join(wide)
  # Each exception still matches a line: a page that wraps it drops it.
  for page, rules in WIDER.items():
    lines = [line for _, _, line in fenced_lines((ROOT / "docs" / page).read_text())]
    for regex, _ in rules:
      assert any(re.match(regex, l) and len(l) > WIDTH for l in lines), (page, regex)


# Pages that still say "this machine", until they name it.
_UNNAMED_MACHINE: dict[str, str] = {}


def test_the_docs_name_the_machine_a_figure_comes_from():
  """A reader does not know which machine "this machine" is: the pages say
  which (a 2-core x86_64 machine without a GPU, an NVIDIA H200, ...)."""
  found = {path.name for path in sorted((ROOT / "docs").glob("*.md"))
           for line in path.read_text().splitlines()
           if re.search(r"\bthis (shared )?(2-core )?(CPU )?machine\b", line, re.I)}
  assert found <= set(_UNNAMED_MACHINE), sorted(found - set(_UNNAMED_MACHINE))
  assert set(_UNNAMED_MACHINE) <= found, (  # named now: drop the exception
      sorted(set(_UNNAMED_MACHINE) - found))

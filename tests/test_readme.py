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

"""Ranks the exchanges for the three setups of docs/which_compressor.md.

    python docs/which_compressor.py

Each setup is one ``jaxcomp whatif`` command (printed above its table, in
lines of at most 100 columns) and one more with ``--diloco-every 50`` for
DiLoCo; the table is their rows
sorted by predicted step time. ``tests/test_docs.py`` checks that the page
shows what this prints. The model's inputs are the built-in profiles
(compute from FLOP counts at an assumed 15 TFLOP/s, not measured) and
``--codec none`` (encode and decode free: the best case for compression);
the last column says how much encode + decode time per step a compressor
may spend before it stops beating dense.
"""

from __future__ import annotations

import contextlib
import io
import shlex

from jaxcomp import cli

COMPRESSORS = ("bf16", "int8_block", "int8_block:bits=4", "qsgd",
               "topk:ratio=0.01", "powersgd:rank=4", "sign")
DILOCO = ("int8_block:bits=4",)
SYNC_EVERY = 50
COMMON = "--buckets 25 --codec none"

SETUPS = (
    ("A. ResNet-50 (25.6M parameters), 16 GPUs on one fast fabric: "
     "ring at 100 Gbit/s",
     "--profile resnet50 -p 16 -b 100"),
    ("B. GPT-2 small (124M parameters), 16 GPUs over 10 Gbit/s Ethernet: "
     "ring at 10 Gbit/s",
     "--profile gpt2-small -p 16 -b 10"),
    ("C. GPT-2 small, 2 nodes of 8 GPUs, 1 Gbit/s between the nodes "
     "(1200 Gbit/s inside): hierarchical",
     "--profile gpt2-small -p 16 -b 1 --algorithm hierarchical "
     "--workers-per-node 8"),
)


def whatif(command: str) -> list[dict]:
  """The compressor rows that ``command`` (``jaxcomp whatif ...``) prints."""
  argv = shlex.split(command)
  assert argv[:2] == ["jaxcomp", "whatif"], command
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    code = cli.main(argv[1:])
  if code:
    raise SystemExit(f"{command} exited {code}")
  lines = out.getvalue().splitlines()
  start = next(i for i, l in enumerate(lines) if l.startswith("compressor "))
  rows = []
  for line in lines[start + 2:]:
    if not line.strip():
      break
    name, collective, mb, step, _, _, _, _, speedup = line.split()
    rows.append({"name": name, "collective": collective, "mb": float(mb),
                 "step": float(step), "speedup": speedup})
  return rows


def ranking(setup_args: str) -> tuple[list[str], list[list[str]]]:
  commands = [f"jaxcomp whatif {setup_args} {COMMON} -c {' '.join(COMPRESSORS)}",
              f"jaxcomp whatif {setup_args} {COMMON} --diloco-every {SYNC_EVERY} "
              f"-c {' '.join(DILOCO)}"]
  rows = whatif(commands[0])
  dense = next(r for r in rows if r["name"] == "dense")
  for r in whatif(commands[1]):
    if r["name"] != "dense":
      r["name"] = f"DiLoCo H={SYNC_EVERY}, {r['name']}"
      rows.append(r)
  rows.sort(key=lambda r: (r["step"], r["name"]))
  table = []
  for i, r in enumerate(rows, 1):
    budget = dense["step"] - r["step"]
    table.append([str(i), r["name"], r["collective"], f"{r['mb']:.2f}",
                  f"{r['step']:.1f}", r["speedup"],
                  "-" if r is dense else (f"{budget:.1f}" if budget > 0 else "none")])
  return commands, table


WIDTH = 100  # the page's code blocks fit 100 columns


def wrapped(command: str, width: int = WIDTH) -> str:
  """``$ command``, broken into shell continuation lines (`` \\``) of at
  most ``width`` columns, never between an option and its first value."""
  words = shlex.split(command)
  units = []  # an option with its first value, or one word
  for w in words:
    if units and units[-1].startswith("-") and " " not in units[-1] \
        and not w.startswith("-"):
      units[-1] += f" {w}"
    else:
      units.append(w)
  lines, line = [], "$"
  for u in units:
    if len(line) + 1 + len(u) + 2 > width:  # room for " \\"
      lines.append(line + " \\")
      line = "   "
    line += f" {u}"
  return "\n".join(lines + [line])


def main() -> None:
  header = ["rank", "exchange", "collective", "MB/worker", "step ms",
            "speedup", "codec budget ms"]
  for title, args in SETUPS:
    commands, table = ranking(args)
    print(title)
    for c in commands:
      print(wrapped(c))
    widths = [max(len(row[i]) for row in [header] + table) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths]] + table:
      print("  ".join(c.ljust(w) if i in (1, 2) else c.rjust(w)
                      for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    print()


if __name__ == "__main__":
  main()

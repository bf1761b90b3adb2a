"""``jaxcomp autotune``: the kernel compressors' paths (XLA, the Mosaic GPU
and the Triton kernels) timed on the user's own GPU, the fastest kept in the
autotuning cache
(:mod:`jaxcomp.kernels`' autotuner), and the tables it prints. The command
line (:mod:`jaxcomp.cli`) registers :func:`add_autotune_command`; the device
check (``benchmarks/device_check.py``) reuses the rest.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxcomp import compressors
from jaxcomp import kernels

__all__ = ["add_autotune_command", "autotune_rows", "autotune_table",
           "cache_entries", "simulated_tuner", "AUTOTUNE_OPS", "AUTOTUNE_SIZES"]

AUTOTUNE_OPS = ("topk", "qsgd", "sign", "int8_block", "fp8_block")
AUTOTUNE_SIZES = (1 << 20, 1 << 24)
SIMULATED_SIZES = (4096,)


def _element_count(s: str) -> int:
  """An argparse type: an element count >= 1 (``1048576``, ``1e6``, ``2**20``)."""
  try:
    base, sep, exp = s.partition("**")
    v = int(base) ** int(exp) if sep else int(float(s))
  except (ValueError, OverflowError):
    v = None
  if v is None or v < 1:
    raise argparse.ArgumentTypeError(
        f"a size is an element count >= 1 (1048576, 1e6 or 2**20), got {s!r}")
  return v


def simulated_tuner(cache_path: str | None) -> kernels.Autotuner:
  """An :class:`jaxcomp.kernels.Autotuner` on a simulated GPU: the Pallas
  candidates run in interpret mode and both paths are timed for real (2
  trials of at most 2 calls), for trying autotuning off GPUs. Its table is
  keyed ``simulated GPU (<platform>, interpret)``, never a real GPU's."""
  return kernels.Autotuner(
      cache_path=cache_path, nvidia=True, interpret=True,
      device_kind=f"simulated GPU ({jax.devices()[0].platform}, interpret)",
      timer=lambda key, impl, fn, a: kernels.measure_seconds(
          fn, a, repeats=2, max_calls=2))


def autotune_rows(ops: Sequence[str], sizes: Sequence[int],
                  tuner: kernels.Autotuner) -> list[dict]:
  """Autotunes each compressor in ``ops`` (names for
  :func:`jaxcomp.compressors.get`) on its encode of a float32 vector of each
  element count in ``sizes``; every decision is read from ``tuner``'s cache
  file or measured and written there.

  Returns:
    One dict per decision: ``key``, ``from`` (``"<op> encode, n=<n>"``),
    ``source`` and :meth:`jaxcomp.kernels.Decision.to_json`'s fields
    (``implementation``, ``seconds`` per call of each path, ``errors``,
    ``n``, ``when``).
  """
  rows = []
  for name in ops:
    c = compressors.get(name)
    for n in sizes:
      for d in kernels.autotune(c.encode, jax.ShapeDtypeStruct((n,), jnp.float32),
                                jax.random.key(0), tuner=tuner):
        rows.append({"key": str(d.key), "from": f"{name} encode, n={n:,}",
                     **d.to_json(), "source": d.source})
  return rows


def cache_entries(path: str, table: str) -> list[tuple[str, dict]]:
  """The entries of ``table`` in the autotuning cache file at ``path``,
  sorted by key; none where the file is missing or unreadable."""
  try:
    with open(path, encoding="utf-8") as f:
      return sorted(json.load(f)["tables"].get(table, {}).items())
  except (OSError, ValueError, KeyError):
    return []


# The timed paths' columns, in this order where any row has them ("pallas":
# a table of the releases that timed one Pallas path against XLA).
TABLE_PATHS = ("xla", "mosaic", "triton", "pallas")


def autotune_table(rows: Sequence[dict]) -> str:
  """A markdown table of decisions (:func:`autotune_rows`' dicts, or cache
  entries with ``key`` and ``from``): the choice, milliseconds per call of
  each timed path (XLA, the Mosaic GPU and the Triton kernel; ``failed``
  where one did not compile or run, blank where the op had none) and XLA's
  time over the choice's."""
  paths = [p for p in TABLE_PATHS
           if any(p in r.get("seconds", {}) for r in rows)]
  lines = ["| key | from | choice | "
           + "".join(f"{p} ms | " for p in paths) + "xla / choice |",
           "| --- | --- | --- | " + "--- | " * len(paths) + "--- |"]
  for r in rows:
    s = r.get("seconds", {})
    cells = ["" if p not in s else "failed" if s[p] is None
             else f"{s[p] * 1e3:.4f}" for p in paths]
    x, c = s.get("xla"), s.get(r["implementation"])
    ratio = f"{x / c:.2f}" if x and c else ""
    lines.append(f"| {r['key']} | {r['from']} | {r['implementation']} | "
                 + "".join(f"{cell} | " for cell in cells) + f"{ratio} |")
  return "\n".join(lines)


def _run_autotune(args) -> int:
  """``jaxcomp autotune``: tunes (or, with --show, reads) and prints the table."""
  tuner = simulated_tuner(args.cache) if args.simulate else kernels.Autotuner(
      cache_path=args.cache)
  path = tuner.cache_path
  if args.show:
    if path is None:
      raise ValueError("--show reads the cache file, and the cache is memory "
                       "only (--cache none or JAXCOMP_AUTOTUNE_CACHE=none)")
    rows = [{"key": key, "from": "cache file", **entry}
            for key, entry in cache_entries(path, tuner.table_name())]
  else:
    if not tuner.nvidia:
      print("not an NVIDIA GPU: implementation=None takes XLA here and nothing "
            "is timed (--simulate tries the command in interpret mode)")
    sizes = args.sizes or (SIMULATED_SIZES if args.simulate else AUTOTUNE_SIZES)
    rows = autotune_rows(args.ops, sizes, tuner)
  print(f"device: {tuner.device_kind}")
  print(f"cache: {path or 'none (memory only)'}, table {tuner.table_name()!r}")
  if rows:
    print(autotune_table(rows))
  elif args.show:
    print("the cache file has no entries for this device and these versions "
          "(jaxcomp autotune fills it)")
  else:
    print("no decisions: nothing is tuned off NVIDIA GPUs")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"device": tuner.device_kind, "table": tuner.table_name(),
                 "decisions": rows}, f, indent=1)
    print(f"wrote {args.json}")
  return 0


def add_autotune_command(sub):
  p = sub.add_parser(
      "autotune", help="time the Pallas kernels (Mosaic GPU, Triton) against "
      "XLA on this GPU and keep the fastest in the autotuning cache",
      description="Autotune the kernel compressors' encodes on this machine's "
      "NVIDIA GPU: for each op and size, time XLA and the op's Mosaic GPU "
      "and Triton kernels, keep the fastest in the cache file that implementation=None reads "
      "(jaxcomp.kernels.Autotuner; one table per GPU kind and JAX, jaxlib and "
      "jaxcomp version), and print the decisions. Keys already in the cache "
      "are read, not timed again. Off NVIDIA GPUs XLA is taken and nothing is "
      "timed.")
  p.add_argument("--ops", nargs="+", choices=AUTOTUNE_OPS, default=list(AUTOTUNE_OPS),
                 help=f"compressors whose encode is tuned (default: {' '.join(AUTOTUNE_OPS)})")
  p.add_argument("--sizes", nargs="+", type=_element_count, default=None, metavar="N",
                 help="float32 element counts, e.g. 1e6 or 2**20; each tunes its size "
                 "class (2**(c-1) < n <= 2**c) (default: 2**20 2**24; 4096 with --simulate)")
  p.add_argument("--cache", default=None, metavar="PATH",
                 help="the cache file (default: $JAXCOMP_AUTOTUNE_CACHE, else "
                 "$XDG_CACHE_HOME/jaxcomp/autotune.json or ~/.cache/jaxcomp/autotune.json; "
                 "'none': memory only)")
  p.add_argument("--show", action="store_true",
                 help="print the cache file's table for this GPU and these versions; "
                 "time nothing")
  p.add_argument("--json", metavar="PATH", help="also write the decisions here")
  p.add_argument("--simulate", action="store_true",
                 help="a simulated GPU: the Pallas kernels in interpret mode, timed for "
                 "real at small sizes (to try the command off GPUs; its own cache table)")
  p.set_defaults(func=_run_autotune)


if __name__ == "__main__":  # a library module: its command is on the CLI
  sys.exit("jaxcomp.autotune is not a command: run `jaxcomp autotune ...` "
           "(or `python -m jaxcomp autotune ...`)")

"""Command line of the benchmarks: ``python -m jaxcomp.bench <name> [...]``.

Each subcommand is a module of this package with ``add_arguments(parser)`` and
``main(args) -> int``; register a new one in ``SUBCOMMANDS`` (modules are
imported by name when the parser is built, so this file imports none of them).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "kernels": ("jaxcomp.bench.kernels",
                "top-k and quantization kernels vs memory pass / lax.top_k / "
                "XLA reference"),
    "device-check": ("jaxcomp.bench.device_check",
                     "check a GPU end to end within a time budget: compiled "
                     "kernel tests, kernel benchmark, example steps, "
                     "autotuner table"),
}


def build_parser() -> argparse.ArgumentParser:
  assert __doc__ is not None  # the module's docstring
  parser = argparse.ArgumentParser(prog="python -m jaxcomp.bench",
                                   description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True)
  for name, (module, help_text) in SUBCOMMANDS.items():
    p = sub.add_parser(name, help=help_text)
    importlib.import_module(module).add_arguments(p)
    p.set_defaults(_module=module)
  return parser


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = build_parser().parse_args(argv)
  args.argv = argv[1:]  # the subcommand's own arguments, for its records
  return importlib.import_module(args._module).main(args) or 0


if __name__ == "__main__":
  sys.exit(main())

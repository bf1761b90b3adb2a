"""Reading XLA's HLO text: the lines of a module and each instruction's
result type, the computation each line sits in, the elements and bytes of
a typed shape, and an op's operands and attributes (for
:mod:`jaxcomp.hlo.traffic`)."""

from __future__ import annotations

import re
from typing import Any

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
    "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4,
    "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1, "f8e3m4": 1, "c64": 8, "c128": 16,
}
_SHAPE_RE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_DEF_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s")


def _elements_and_bytes(shape_text: str) -> list[tuple[int, float]]:
  """``(elements, bytes)`` of every typed shape in ``shape_text``."""
  out = []
  for dtype, dims in _SHAPE_RE.findall(shape_text):
    if dtype not in _DTYPE_BYTES:
      continue
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    out.append((n, n * _DTYPE_BYTES[dtype]))
  return out


def _shape_bytes(text: str) -> int:
  return int(sum(b for _, b in _elements_and_bytes(text)))


def _split_top(args: str) -> list[str]:
  """Splits an operand list at commas outside brackets."""
  out, depth, cur = [], 0, []
  for ch in args:
    if ch in "[{(":
      depth += 1
    elif ch in "]})":
      depth -= 1
    if ch == "," and depth == 0:
      out.append("".join(cur))
      cur = []
    else:
      cur.append(ch)
  out.append("".join(cur))
  return out


def _operands_and_attributes(rest: str) -> tuple[str, str]:
  """Splits what follows an op's opening parenthesis into its operand list
  and its attributes, at the matching closing parenthesis."""
  depth = 1
  for i, ch in enumerate(rest):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0:
      return rest[:i], rest[i + 1:]
  return rest, ""


_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_CALLS_RE = re.compile(
    r"(to_apply|calls|body|condition|true_computation|false_computation"
    r"|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")


def _computations(lines):
  """``(computation of each line, branch-only computations)``: the name of
  the computation every line sits in, and the computations reachable only
  through a conditional's branches."""
  where, current = [], ""
  calls: dict[str, set] = {}
  branch_roots: set = set()
  for line in lines:
    m = _COMP_RE.match(line)
    if m and not line.startswith(" "):
      current = m.group(1)
    where.append(current)
    for key, target in _CALLS_RE.findall(line):
      names = {t.strip().lstrip("%") for t in target.strip("{}").split(",")}
      calls.setdefault(current, set()).update(names)
      if key in ("true_computation", "false_computation",
                 "branch_computations"):
        branch_roots |= names
  inside = set()
  todo = list(branch_roots)
  while todo:
    c = todo.pop()
    if c not in inside:
      inside.add(c)
      todo.extend(calls.get(c, ()))
  return where, inside


def _module(compiled: Any) -> tuple[list[str], dict[str, str]]:
  """The lines of a compiled (or lowered) module's HLO text, or of HLO
  text, and the result type of every named instruction."""
  if isinstance(compiled, str):
    text = compiled
  elif hasattr(compiled, "compile"):  # jax.stages.Lowered
    text = compiled.as_text(dialect="hlo")
  else:
    text = compiled.as_text()
  text = re.sub(r"/\*.*?\*/", "", text)  # e.g. /*index=5*/ in long tuples
  lines = text.splitlines()
  shapes: dict[str, str] = {}
  for line in lines:
    m = _DEF_RE.match(line)
    if m:
      shapes[m.group(1)] = m.group(2)
  return lines, shapes

"""Collective traffic read from a compiled XLA HLO module.

``collective_traffic(jax.jit(step).lower(*args).compile())`` lists every
collective op of the optimised module with its operand bytes and replica
groups, and totals what each device sends. Tests assert traffic with it.

Two per-device figures are reported per op:

* ``operand_bytes``: the bytes this device hands to the collective (its
  contribution). This is what compression shrinks.
* ``ring_bytes``: what a bandwidth-optimal ring algorithm moves out of each
  device for that op over its group, from the cost table in
  :mod:`jaxcomp.wire` (all-gather grows linearly with the device count, so
  all-gather-based compressors do too).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from jaxcomp import wire
from jaxcomp.hlo._text import _CALLS_RE
from jaxcomp.hlo._text import _COMP_RE
from jaxcomp.hlo._text import _computations
from jaxcomp.hlo._text import _elements_and_bytes
from jaxcomp.hlo._text import _module
from jaxcomp.hlo._text import _operands_and_attributes
from jaxcomp.hlo._text import _shape_bytes
from jaxcomp.hlo._text import _split_top

_INSTR_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+"
    r"(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)"
    r"(-start)?\((.*)$")


def _iota(dims: str, perm: str | None) -> np.ndarray:
  """XLA's iota device list ``[dims]T(perm)`` (``dims`` and ``perm`` as
  written, comma-separated), flat: ``arange`` reshaped to ``dims`` and
  transposed by ``perm``."""
  shape = [int(v) for v in dims.split(",")]
  ids = np.arange(int(np.prod(shape))).reshape(shape)
  if perm:
    ids = ids.transpose([int(v) for v in perm.split(",")])
  return ids.reshape(-1)


def _device_ids(text: str | None, n: int) -> np.ndarray:
  """The device ids of a mesh form's ``device_ids=(...)``, in mesh order:
  ``[dims]T(perm)`` is an iota (:func:`_iota`), else the ids listed; none
  given is 0..n-1."""
  if not text:
    return np.arange(n)
  m = re.fullmatch(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text.strip())
  if m:
    return _iota(m.group(1), m.group(2))
  return np.array([int(v) for v in text.split(",") if v.strip()])


def _parse_groups(attrs: str, num_devices: int | None) -> list[list[int]]:
  m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?",
                attrs)
  if m:
    g, s = (int(v) for v in m.group(1).split(","))
    return _iota(m.group(2), m.group(3)).reshape(g, s).tolist()
  # The mesh form XLA writes for collectives over mesh axes:
  # replica_groups=mesh['a'=4,'b'=1,'c'=2] {'a'}: one group per combination
  # of the other axes, the devices numbered in the mesh's row-major order,
  # or, where a device_ids=(...) follows the mesh, the ids it lists in that
  # order (an iota [dims]T(perm), as in the first form, or the ids).
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]"
                r"(?:,\s*device_ids=\((\[[0-9,]+\](?:T\([0-9,]+\))?|[0-9,\s]+)\))?"
                r"\s*\{([^}]*)\}", attrs)
  if m:
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names = [a for a, _ in axes]
    sizes = [int(n) for _, n in axes]
    grouped = re.findall(r"'([^']+)'", m.group(3))
    ids = _device_ids(m.group(2), int(np.prod(sizes))).reshape(sizes)
    rest = [i for i, a in enumerate(names) if a not in grouped]
    inner = [names.index(a) for a in grouped]
    size = int(np.prod([sizes[i] for i in inner]))
    return ids.transpose(rest + inner).reshape(-1, size).tolist()
  m = re.search(r"replica_groups=\{(.*?)\}\}", attrs)
  if m:
    return [[int(v) for v in grp.split(",") if v.strip()]
            for grp in re.findall(r"\{([0-9,\s]*)", m.group(1) + "}")]
  m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
  if m:
    return [[int(v) for v in grp.split(",")]
            for grp in re.findall(r"\{([0-9,\s]*)", m.group(1) + "}")]
  return [list(range(num_devices))] if num_devices else []


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
  """One collective of the compiled module (bytes per device).

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> f = jax.jit(jax.shard_map(lambda g: jax.lax.all_gather(g, "data"),
    ...                           mesh=mesh, in_specs=P("data"),
    ...                           out_specs=P("data")))
    >>> g = jax.device_put(jnp.ones((jax.device_count(), 64)),
    ...                    NamedSharding(mesh, P("data")))
    >>> op, = jaxcomp.collective_traffic(f.lower(g).compile()).ops
    >>> op.kind, op.operand_bytes, op.result_bytes, op.group_size
    ('all-gather', 256, 2048, 8)
    >>> op.ring_bytes  # a ring all-gather sends p - 1 blocks per device
    1792.0
  """

  kind: str  # "all-reduce", "all-gather", "all-to-all", ...
  name: str  # the HLO instruction name
  operand_bytes: int  # bytes one device hands in (sum over tuple operands)
  result_bytes: int  # bytes one device gets out
  replica_groups: list[list[int]]  # device groups (pairs for permute)
  group_size: int  # devices per group (2 for collective-permute)
  ring_bytes: float  # bytes a ring sends per device (see module docstring)
  # Bytes of each operand. XLA's combiner passes merge same-kind collectives
  # into one op over a tuple, but XLA:CPU (gloo) still runs one collective
  # per operand, each paying the start-up cost: that is the message count
  # a cost model needs (``Traffic.messages``).
  operand_sizes: tuple[int, ...] = ()
  computation: str = ""  # the HLO computation the op sits in
  # Whether the op runs only inside a branch of a conditional (``lax.cond``,
  # e.g. the k-th micro-step of jaxcomp.multi_steps), not on every step.
  in_branch: bool = False


@dataclasses.dataclass(frozen=True)
class Traffic:
  """All collectives of a module and their per-device totals.

  Example:
    What one compressed exchange sends: top-k 1% of 16,384 float32
    gradient entries per device, all-gathered as values and indices:

    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = jaxcomp.compressed_mean("topk", "data", ratio=0.01)
    >>> grads = {"w": jnp.zeros((16384,))}
    >>> state, specs = jaxcomp.placement.init_sharded(tx, grads, mesh, "data")
    >>> def exchange(g, state):
    ...   mean, state = tx.update(jaxcomp.placement.to_varying(g, "data"),
    ...                           jaxcomp.placement.to_local(state, specs))
    ...   return mean, jaxcomp.placement.to_global(state, specs)
    >>> f = jax.jit(jax.shard_map(exchange, mesh=mesh,
    ...                           in_specs=(P(), specs),
    ...                           out_specs=(P(), specs)))
    >>> traffic = jaxcomp.collective_traffic(f.lower(grads, state).compile())
    >>> print(traffic.table())  # doctest: +ELLIPSIS
    kind                   operand B        ring B  group  name
    all-reduce                     4             7      8  ...
    all-gather                   656          4592      8  ...
    all-gather                   656          4592      8  ...
    total per device            1316          9191
    >>> traffic.by_kind()  # the non-finite check, then 164 values and indices
    {'all-reduce': 4, 'all-gather': 1312}
  """

  ops: list[CollectiveOp]
  operand_bytes: int  # sum of ops' operand bytes, per device
  ring_bytes: float  # sum of ops' ring bytes, per device

  @property
  def messages(self) -> list[tuple[str, int]]:
    """``(kind, operand bytes)`` of every operand of every op, in program order.

    A tuple-shaped all-reduce or all-gather (what XLA's combiners make)
    counts once per operand: XLA:CPU's collectives run each operand as its
    own gloo collective. An all-to-all counts once: its tuple form holds one
    operand per peer of a single exchange.
    """
    return [(op.kind, b) for op in self.ops
            for b in ((op.operand_bytes,) if op.kind == "all-to-all" or not op.operand_sizes
                      else op.operand_sizes)]

  def every_step(self) -> Traffic:
    """The collectives that run on every step: those outside the branches
    of a conditional."""
    return _traffic([op for op in self.ops if not op.in_branch])

  def in_branches(self) -> Traffic:
    """The collectives inside the branches of a conditional (run only on the
    steps that take the branch)."""
    return _traffic([op for op in self.ops if op.in_branch])

  def by_kind(self) -> dict[str, int]:
    """Operand bytes per device for each collective kind present."""
    out: dict[str, int] = {}
    for op in self.ops:
      out[op.kind] = out.get(op.kind, 0) + op.operand_bytes
    return out

  def largest(self) -> int:
    """Operand bytes of the largest single collective (0 if none)."""
    return max((op.operand_bytes for op in self.ops), default=0)

  def table(self) -> str:
    """A printable table of the ops."""
    rows = [f"{'kind':<20}{'operand B':>12}{'ring B':>14}{'group':>7}  name"]
    for op in self.ops:
      rows.append(f"{op.kind:<20}{op.operand_bytes:>12}{op.ring_bytes:>14.0f}"
                  f"{op.group_size:>7}  {op.name}")
    rows.append(f"{'total per device':<20}{self.operand_bytes:>12}"
                f"{self.ring_bytes:>14.0f}")
    return "\n".join(rows)


def _traffic(ops) -> Traffic:
  return Traffic(ops, sum(o.operand_bytes for o in ops),
                 sum(o.ring_bytes for o in ops))


def collective_traffic(compiled: Any, num_devices: int | None = None) -> Traffic:
  """Reads the collectives of a compiled (or lowered) JAX computation.

  Read the *compiled* module to see what the backend really sends, or the
  *lowered* one for what the program asks for before backend passes: on CPU,
  XLA promotes bfloat16 all-reduces to float32 (so a bf16 cast saves nothing
  there), while GPUs (NCCL) reduce bfloat16 natively.

  Args:
    compiled: ``jax.jit(f).lower(*args).compile()``, a lowered
      ``jax.jit(f).lower(*args)``, or HLO text.
    num_devices: devices in the computation, used where an op lists no
      replica groups (meaning: all devices).

  Returns:
    A :class:`Traffic` with one :class:`CollectiveOp` per collective (async
    ``-start``/``-done`` pairs counted once).

  Example:
    A ``psum`` of 256 float32 per device, on 8 devices:

    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> f = jax.jit(jax.shard_map(lambda g: jax.lax.psum(g, "data"),
    ...                           mesh=mesh, in_specs=P("data"),
    ...                           out_specs=P()))
    >>> g = jax.device_put(jnp.ones((jax.device_count(), 256)),
    ...                    NamedSharding(mesh, P("data")))
    >>> traffic = jaxcomp.collective_traffic(f.lower(g).compile())
    >>> print(traffic.table())  # doctest: +ELLIPSIS
    kind                   operand B        ring B  group  name
    all-reduce                  1024          1792      8  ...
    total per device            1024          1792
  """
  lines, shapes = _module(compiled)
  ops = []
  where, branch_only = _computations(lines)
  for line, computation in zip(lines, where):
    m = _INSTR_RE.match(line)
    if not m:
      continue
    name, result_type, kind, start, rest = m.groups()
    args, attrs = _operands_and_attributes(rest)
    sizes = []
    for arg in filter(None, (a.strip() for a in _split_top(args))):
      if "[" in arg:  # typed operand, e.g. "f32[8]{0} %x"
        sizes.append(_shape_bytes(arg))
      else:
        sizes.append(_shape_bytes(shapes.get(arg.lstrip("%"), "")))
    operand = sum(sizes)
    groups = _parse_groups(attrs, num_devices)
    g = len(groups[0]) if groups else 1
    if kind == "collective-permute":
      g = 2
    result = _shape_bytes(result_type)
    if start:  # async start returns (operands..., results...): halve
      result -= operand
    ops.append(CollectiveOp(kind, name, operand, result, groups, g,
                            wire.ring_bytes(kind, operand, g), tuple(sizes),
                            computation, computation in branch_only))
  return _traffic(ops)


# ----------------------------------------------------------------------------
# Memory passes: the big buffers each top-level op of a module reads and writes.
# ----------------------------------------------------------------------------

# Ops that move no data (views, bookkeeping) or whose bodies are counted
# where they run (control flow).
_FREE_OPS = frozenset({
    "parameter", "constant", "bitcast", "tuple", "get-tuple-element",
    "after-all", "partition-id", "replica-id", "iota", "while", "conditional",
    "call", "add-dependency", "opt-barrier", "copy-done", "all-gather-done",
    "all-reduce-done", "collective-permute-done", "async-done",
})
# Ops (or fusion roots) that read only what their output selects.
_SELECTING_OPS = frozenset({"gather", "dynamic-slice", "slice"})
# Ops (or fusion roots) that update operand 0 in place: they write only the
# update, not the whole result.
_IN_PLACE_OPS = frozenset({"dynamic-update-slice", "scatter"})
_OP_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|[^\s]+)\s+"
                    r"([\w\-]+)\((.*)$")


@dataclasses.dataclass(frozen=True)
class MemoryOp:
  """One top-level op of a compiled module that touches a big buffer."""

  name: str  # the HLO instruction name
  opcode: str  # "fusion", "copy", "sort", "all-gather", ...
  read_bytes: int  # bytes of big buffers read
  write_bytes: int  # bytes of big buffers written
  computation: str  # the computation it runs in (ENTRY, a loop body, ...)
  # Whether it runs only inside a branch of a conditional (a fallback that
  # most steps skip), not on every step.
  in_branch: bool = False


@dataclasses.dataclass(frozen=True)
class MemoryPasses:
  """The memory traffic of a module over big buffers, op by op."""

  ops: list[MemoryOp]
  min_elements: int

  @property
  def read_bytes(self) -> int:
    """Bytes read by the ops that run on every step (outside branches)."""
    return sum(o.read_bytes for o in self.ops if not o.in_branch)

  @property
  def write_bytes(self) -> int:
    """Bytes written by the ops that run on every step."""
    return sum(o.write_bytes for o in self.ops if not o.in_branch)

  def passes(self, n_bytes: int) -> float:
    """Reads plus writes of the every-step ops, in passes over a buffer of
    ``n_bytes``."""
    return (self.read_bytes + self.write_bytes) / n_bytes

  def branch_passes(self, n_bytes: int) -> float:
    """Reads plus writes of the ops inside conditional branches (all
    branches added up: an upper bound of what one step's branches cost)."""
    return sum(o.read_bytes + o.write_bytes for o in self.ops
               if o.in_branch) / n_bytes

  def table(self) -> str:
    rows = [f"{'read B':>12}{'write B':>12}  opcode / name"]
    for o in self.ops:
      rows.append(f"{o.read_bytes:>12}{o.write_bytes:>12}  {o.opcode} {o.name}"
                  + ("" if o.computation == "ENTRY" else f" [{o.computation}"
                     + (", branch]" if o.in_branch else "]")))
    return "\n".join(rows)


def _big_bytes(shape_text: str, min_elements: int) -> float:
  return sum(b for n, b in _elements_and_bytes(shape_text) if n >= min_elements)


def _layout_of(lines: list[str], where: list[str]
               ) -> tuple[dict[str, list[str]], set, str]:
  """``(bodies, inlined, entry)`` of a module: each computation's lines by
  its name, the computations that are not top level (fusion bodies and
  reducers, named by ``calls=`` / ``to_apply=``) and the entry
  computation's name."""
  bodies: dict[str, list[str]] = {}
  inlined: set = set()  # fusion bodies and reducers: not top level
  for line, comp in zip(lines, where):
    bodies.setdefault(comp, []).append(line)
    for key, target in _CALLS_RE.findall(line):
      if key in ("calls", "to_apply"):
        inlined |= {t.strip().lstrip("%") for t in target.strip("{}").split(",")}
  entry = next((m.group(1) for line in lines
                for m in [_COMP_RE.match(line)] if m and line.startswith("ENTRY")),
               "")
  return bodies, inlined, entry


def _fused_reads(body: list[str]) -> tuple[str, dict[int, int]]:
  """``(root opcode, {param index: elements read})`` of a fused body (its
  lines).

  Demand flows from the root to the parameters: an op needs of each
  operand the share of its output that is demanded (elementwise ops,
  reshapes, concatenations: proportional), except that slices and
  gathers need only what they select, and reductions (and sorts,
  windows, dots) their whole operand once any output is demanded.
  """
  instrs = []
  for line in body:
    m = _OP_RE.match(line)
    if not m:
      continue
    name, rtype, opcode, rest = m.groups()
    operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
    elems = sum(n for n, _ in _elements_and_bytes(rtype))
    instrs.append((name, elems, opcode, operands, rest,
                   line.lstrip().startswith("ROOT")))
  size = {name: elems for name, elems, *_ in instrs}
  demand = {name: elems for name, elems, _, _, _, is_root in instrs
            if is_root}
  root = next((op for _, _, op, _, _, is_root in instrs if is_root), "")
  params = {}
  for name, elems, opcode, operands, rest, _ in reversed(instrs):
    if opcode == "parameter":
      number = re.match(r"\s*(\d+)", rest)
      assert number is not None  # "parameter(N)"
      params[int(number.group(1))] = demand.get(name, 0)
      continue
    d = demand.get(name, 0)
    for o in operands:
      if o not in size:
        continue
      if not d:
        need = 0
      elif opcode in _SELECTING_OPS:
        need = min(size[o], elems) if o == operands[0] else size[o]
      elif opcode in ("reduce", "reduce-window", "sort", "dot",
                      "convolution", "scatter", "select-and-scatter"):
        need = size[o]
      else:
        need = min(size[o], -(-size[o] * d // max(elems, 1)))
      demand[o] = max(demand.get(o, 0), need)
  return root, params


def _op_traffic(opcode: str, rtype: str, rest: str, shapes: dict[str, str],
                bodies: dict[str, list[str]], min_elements: int
                ) -> tuple[float, float]:
  """``(reads, writes)``: the bytes of big buffers one top-level op reads
  and writes (``rtype`` its result type, ``rest`` the text after its
  opcode's parenthesis; see :func:`memory_passes` for the rules)."""
  operands, attrs = _operands_and_attributes(rest)
  args = [a.strip() for a in _split_top(operands) if a.strip()]
  root, read_elements = opcode, {}
  called = re.search(r"calls=%?([\w.\-]+)", attrs)
  if opcode == "fusion" and called:
    root, read_elements = _fused_reads(bodies.get(called.group(1), []))
  reads = 0.0
  arg_types = []
  for i, arg in enumerate(args):
    t = arg if "[" in arg else shapes.get(arg.lstrip("%"), "")
    arg_types.append(t)
    big = _big_bytes(t, min_elements)
    if big and i in read_elements:
      # what the fused body demands of this operand
      big = min(big, sum(min(n, read_elements[i]) * b / n
                         for n, b in _elements_and_bytes(t)))
    if big and opcode in _SELECTING_OPS and i == 0:
      big = min(big, _shape_bytes(rtype))
    reads += big
  writes = _big_bytes(rtype, min_elements)
  if root in _IN_PLACE_OPS and arg_types:
    # operand 0 is updated in place: neither read nor written whole
    whole = _big_bytes(arg_types[0], min_elements)
    reads -= whole
    writes = max(writes - whole, 0.0)
  if opcode.endswith("-start"):  # async collective: (operands, results)
    writes = max(writes - reads, 0.0)
  return reads, writes


def memory_passes(compiled: Any, min_elements: int) -> MemoryPasses:
  """Counts the reads and writes of big buffers in a compiled module.

  Every op that runs at top level (in the entry computation, a loop body or
  a conditional's branch, the latter reported apart: a fallback branch
  costs only on the steps that take it; a fusion is one op, whatever it
  fuses) is
  charged the bytes of the operands and results that hold at least
  ``min_elements`` elements. Views (bitcast, tuple) and control flow are
  free. A fusion is charged, of each operand, the elements its body
  demands: demand flows back from the fusion's output, proportionally
  through elementwise ops and reshapes, only the selected elements through
  slices and gathers, whole operands through reductions (so a fusion that
  computes one slice of a bucket reads that slice). An in-place update
  (dynamic-update-slice, scatter; also as a fusion's root) writes only its
  update. This is the structural model of a step's memory traffic: a
  gradient-sized float32 buffer read once is one pass of ``4 n`` bytes.

  Args:
    compiled: ``jax.jit(f).lower(*args).compile()`` or HLO text.
    min_elements: the smallest buffer counted (e.g. a quarter of the
      gradient's elements, so that payloads of 1% are not counted).

  Returns:
    A :class:`MemoryPasses`.
  """
  lines, shapes = _module(compiled)
  where, branch_only = _computations(lines)
  bodies, inlined, entry = _layout_of(lines, where)
  ops = []
  for line, comp in zip(lines, where):
    if comp in inlined or not line.startswith(" "):
      continue
    m = _OP_RE.match(line)
    if not m:
      continue
    name, rtype, opcode, rest = m.groups()
    if opcode in _FREE_OPS:
      continue
    reads, writes = _op_traffic(opcode, rtype, rest, shapes, bodies,
                                min_elements)
    if reads or writes:
      ops.append(MemoryOp(name, opcode, int(reads), int(writes),
                          "ENTRY" if comp == entry else comp,
                          comp in branch_only))
  return MemoryPasses(ops, min_elements)

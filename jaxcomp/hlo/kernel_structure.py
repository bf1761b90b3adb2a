"""What XLA does around a Pallas kernel, read from exported StableHLO.

``jax.export.export(jax.jit(f), platforms=["cuda"])`` lowers the Mosaic GPU
kernels on any machine (no GPU needed), and its StableHLO text shows every
op that XLA runs before and after the kernel's ``custom_call``. This module
walks that text and counts the ops that cost memory passes over ``n``-sized
buffers, so tests can assert that a kernel reads its input once and nothing
``n``-sized surrounds it:

* which ops (outside the kernel) read the input ``x`` or a value computed
  from it, and how many kernel calls read it;
* ``transpose``, ``pad``, ``concatenate`` and reductions of ``n``-sized
  values, before and after the kernel;
* random-number ops (``rng_bit_generator``, threefry) and ``n``-sized
  ``iota`` (a counter hash materialized over every element);
* ``n``-sized kernel operands that do not come from ``x`` (e.g. an array of
  uniform numbers or of per-row multipliers).

"``n``-sized" means a tensor of at least ``n // 32`` elements (one per
32 inputs: packed 1-bit words count, one value per bucket of 128 does
not). Views are free and not counted: ``reshape``, ``bitcast_convert`` and
Shardy's ``sharding_constraint`` annotations. The dataflow follows ``call``s into private functions
(``jax.jit`` inside ``jax.jit`` exports as ``func.call``). The Mosaic GPU
kernel itself travels as serialized MLIR bytecode in the custom call's
``backend_config``, so its body is not read here.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

import jax
import jax.extend.core
from jax.extend.mlir import ir
# jax.interpreters.mlir is JAX's public module for lowering rules; its
# make_ir_context is the context with the dialects JAX registers (the gpu
# dialect's memory spaces of a Mosaic GPU kernel's module among them), which
# a bare ``ir.Context()`` lacks.
from jax.interpreters import mlir as jax_mlir

_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_FUNC_RE = re.compile(r"func\.func\s+(?:public|private)\s+@([\w$.\-]+)\((.*?)\)\s*(?:->|\{)")
_ARG_RE = re.compile(r"(%arg\d+)\s*:\s*tensor<((?:\d+x)*)[a-z]\w*>")
_RESULT_RE = re.compile(r"^\s*(%[\w.$\-]+)(?::(\d+))?\s*=\s*(.*)$")
_OP_RE = re.compile(r'^"?([a-z_]+\.[a-z_0-9]+|call|return|func\.return)"?')
_VALUE_RE = re.compile(r"%[\w.$\-]+(?:#\d+)?")
_TENSOR_RE = re.compile(r"tensor<((?:\d+x)*)([a-z]\w*)>")
_CALLEE_RE = re.compile(r"@([\w$.\-]+)")

# Shardy's sharding constraints are annotations (an export under an abstract
# mesh, :func:`export_cuda`, carries them on JAX >= 0.12), not data movement.
VIEWS = ("stablehlo.reshape", "stablehlo.bitcast_convert",
         "sdy.sharding_constraint")
RANDOM = ("stablehlo.rng_bit_generator", "stablehlo.rng")
# The custom call target of a Pallas kernel lowered by Triton.
TRITON_TARGET = "__gpu$xla.gpu.triton"
KERNEL_TARGETS = ("mosaic_gpu", "tpu_custom_call", TRITON_TARGET)


@dataclasses.dataclass
class _Op:
  name: str
  results: list[str]
  operands: list[str]
  sizes: list[int]  # element counts of every tensor type on the line
  result_sizes: list[int]  # element counts of the result types
  callee: str | None
  text: str
  in_branch: bool = False  # inside a region of stablehlo.case / if


@dataclasses.dataclass
class Structure:
  """Counts of one exported module (see the module doc).

  Attributes:
    n: element count of the input ``x``.
    kernels: Pallas / Mosaic custom calls outside conditional branches (the
      ops inside ``stablehlo.case`` / ``if`` regions, and in functions
      called from there, are left out of every count but
      ``branch_kernel_reads_of_x``).
    kernel_reads_of_x: kernel calls with ``x`` (or a value computed from it)
      as an operand.
    x_reads: non-view XLA ops that read ``x`` or an ``n``-sized value
      computed from it before a kernel (``"op"`` names, in order).
    before: non-view ``n``-sized XLA ops not downstream of a kernel.
    after: non-view ``n``-sized XLA ops downstream of a kernel.
    random: random-number ops, threefry calls and ``n``-sized ``iota``.
    other_kernel_operands: ``n``-sized kernel operands not computed from
      ``x`` (an array of random numbers, or of per-row multipliers, that XLA
      wrote for the kernel to read back).
  """
  n: int
  kernels: int = 0
  kernel_reads_of_x: int = 0
  x_reads: list[str] = dataclasses.field(default_factory=list)
  before: list[str] = dataclasses.field(default_factory=list)
  after: list[str] = dataclasses.field(default_factory=list)
  random: list[str] = dataclasses.field(default_factory=list)
  other_kernel_operands: int = 0
  # Kernel calls inside the branches of a conditional (``lax.cond``: a
  # fallback that most calls skip), reading x; not counted above.
  branch_kernel_reads_of_x: int = 0

  def count(self, where: str, op: str) -> int:
    """How many ``op`` (e.g. ``"transpose"``) are in ``where`` (``"before"``,
    ``"after"`` or ``"x_reads"``)."""
    return sum(o == f"stablehlo.{op}" for o in getattr(self, where))

  def summary(self) -> dict:
    """A flat dict of the counts, for assertion messages and printouts."""
    out: dict[str, int | dict[str, int]] = {
        "kernels": self.kernels, "kernel_reads_of_x": self.kernel_reads_of_x,
        "branch_kernel_reads_of_x": self.branch_kernel_reads_of_x,
        "xla_reads_of_x": len(self.x_reads),
        "random": len(self.random),
        "other_kernel_operands": self.other_kernel_operands}
    for where in ("before", "after"):
      out[where] = dict(collections.Counter(
          o.removeprefix("stablehlo.") for o in getattr(self, where)))
    return out


def _size(dims: str) -> int:
  n = 1
  for d in filter(None, dims.split("x")):
    n *= int(d)
  return n


def _parse(text: str):
  """Functions of a module, ``{name: ([(arg name, elements)], ops)}``, and
  the name of the public one."""
  funcs, main, current = {}, None, None
  depth, regions = 0, []  # brace depth; depths where branch regions opened
  for raw in text.splitlines():
    line = _STRING_RE.sub('""', raw)
    line = re.sub(r"\sloc\([^()]*(?:\([^()]*\)[^()]*)*\)", "", line)
    # (read from the raw line: the quoted op name "stablehlo.case" is a
    # string to the line cleaned above)
    opens_branch = bool(re.search(r'^\s*(%[\w.:#]+\s*=\s*)?"?stablehlo\.(case|if)"?\(',
                                  raw))
    before = depth
    depth += line.count("{") - line.count("}")
    while regions and depth <= regions[-1]:
      regions.pop()
    in_branch = bool(regions)
    if opens_branch and depth > before:
      regions.append(before)
    m = _FUNC_RE.search(line)
    if m:
      current = m.group(1)
      funcs[current] = ([(a, _size(d)) for a, d in _ARG_RE.findall(m.group(2))],
                        [])
      if "public" in line and main is None:
        main = current
      continue
    if current is None:
      continue
    m = _RESULT_RE.match(line)
    if m:
      base, count, rest = m.group(1), m.group(2), m.group(3)
      results = ([f"{base}#{i}" for i in range(int(count))] if count
                 else [base])
    else:
      rest, results = line.strip(), []
    op = _OP_RE.match(rest)
    if not op:
      continue
    name = op.group(1)
    callee = None
    if name in ("call", "stablehlo.custom_call"):
      c = _CALLEE_RE.search(rest)
      callee = c.group(1) if c else None
    sizes = [_size(d) for d, _ in _TENSOR_RE.findall(rest)]
    signature = rest.rsplit(" : ", 1)[-1]
    result_types = signature.rsplit("->", 1)[-1]
    result_sizes = [_size(d) for d, _ in _TENSOR_RE.findall(result_types)]
    funcs[current][1].append(_Op(name, results, _VALUE_RE.findall(rest),
                                 sizes, result_sizes, callee, rest,
                                 in_branch and not opens_branch))
  return funcs, main


def _is_kernel(op: _Op) -> bool:
  return op.name == "stablehlo.custom_call" and any(
      t in (op.callee or "") for t in KERNEL_TARGETS)


def analyze(text: str, n: int, x_arg: int = 0) -> Structure:
  """Counts of the module ``text`` whose public function's argument number
  ``x_arg`` is the ``n``-element input.

  Raises:
    ValueError: no public function in ``text``.
  """
  funcs, main = _parse(text)
  if main is None:
    raise ValueError("no public func.func in the module")
  s = Structure(n=n)
  big = max(1, n // 32)

  def walk(fname, x_args, k_args, branch=False):
    """Walks one function whose args in ``x_args`` derive from x and in
    ``k_args`` from a kernel (``branch``: called from a conditional's
    branch); returns the positions of its x-derived, kernel-derived and
    n-sized results."""
    args, ops = funcs[fname]
    big_values = {a for a, size in args if size >= big}
    args = [a for a, _ in args]
    from_x = {a for i, a in enumerate(args) if i in x_args}
    from_k = {a for i, a in enumerate(args) if i in k_args}
    for op in ops:
      ins_x = [v for v in op.operands if v in from_x and v in big_values]
      ins_k = [v for v in op.operands if v in from_k]
      n_sized = any(z >= big for z in op.sizes)
      if op.name in ("return", "func.return"):
        return tuple([i for i, v in enumerate(op.operands) if v in taint]
                     for taint in (from_x, from_k, big_values))
      in_branch = branch or op.in_branch
      if op.name == "call" and op.callee in funcs:
        returned = walk(op.callee,
                        {i for i, v in enumerate(op.operands) if v in from_x},
                        {i for i, v in enumerate(op.operands) if v in from_k},
                        in_branch)
        for taint, positions in zip((from_x, from_k, big_values), returned):
          taint.update(op.results[i] for i in positions
                       if i < len(op.results))
        continue
      if in_branch:  # a fallback: report its kernels' reads apart
        s.branch_kernel_reads_of_x += _is_kernel(op) and bool(ins_x)
        if ins_k:
          from_k.update(op.results)
        elif ins_x:
          from_x.update(op.results)
        continue
      if _is_kernel(op):
        s.kernels += 1
        s.kernel_reads_of_x += bool(ins_x)
        # Operands are listed first; each big one not from x counts.
        s.other_kernel_operands += sum(
            1 for v in op.operands if v not in from_x and v not in from_k
            and v in big_values)
        from_k.update(op.results)
        continue
      if (op.name in RANDOM or "threefry" in (op.callee or "")
          or (op.name == "stablehlo.iota" and n_sized)):
        s.random.append(op.name)
      if op.name in VIEWS or op.name == "stablehlo.constant":
        pass
      elif ins_k and n_sized:
        s.after.append(op.name)
      elif n_sized and not ins_k:
        s.before.append(op.name)
        if ins_x:
          s.x_reads.append(op.name)
      big_values.update(v for v, z in zip(op.results, op.result_sizes)
                        if z >= big)
      if ins_k:
        from_k.update(op.results)
      elif ins_x:
        from_x.update(op.results)
    return [], [], []

  walk(main, {x_arg}, set())
  return s


# The GPU a CUDA export lowers Pallas' Triton kernels for when none is at
# hand: JAX >= 0.11 reads the target's compute capability from the device
# (or an abstract mesh's abstract device); Mosaic GPU kernels need none.
EXPORT_GPU = jax.sharding.AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")


def export_cuda(fn, *args) -> jax.export.Exported:
  """``jax.export`` of ``jax.jit(fn)`` for CUDA with ``args``
  (ShapeDtypeStructs), on a machine with or without a GPU.

  Triton kernel calls (:data:`TRITON_TARGET`) carry no export
  compatibility guarantee: the check is disabled, as this export is read,
  not stored. Where JAX cannot find a GPU to lower a Triton kernel for, the
  export is retried under an abstract mesh of one :data:`EXPORT_GPU` (an
  H100, sm_90), JAX's public way to name a target device.
  """
  checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON_TARGET)]

  def export():
    return jax.export.export(jax.jit(fn), platforms=["cuda"],
                             disabled_checks=checks)(*args)
  try:
    return export()
  except RuntimeError as e:
    if "No supported GPU devices" not in str(e):
      raise
  mesh = jax.sharding.AbstractMesh((1,), ("cuda_export",),
                                   abstract_device=EXPORT_GPU)
  with jax.sharding.use_abstract_mesh(mesh):
    return export()


def export_structure(fn, *args, x_arg: int = 0) -> Structure:
  """Exports ``jax.jit(fn)`` for CUDA with ``args`` (ShapeDtypeStructs) and
  analyzes it; ``args[x_arg]`` is the input ``x``.

  The export is :func:`export_cuda`'s."""
  exported = export_cuda(fn, *args)
  n = 1
  for d in args[x_arg].shape:
    n *= d
  return analyze(exported.mlir_module(), n, x_arg)


@dataclasses.dataclass
class KernelOps:
  """Operations inside one Pallas kernel, per grid block (a proxy for its
  compute), counted from the kernel body's jaxpr in interpret mode (the
  same kernel function; the compiled path adds only layout casts).

  Attributes:
    name: the kernel's name.
    ops: primitive operations in the body (nested ones included; ``jit``
      wrappers are not counted, their contents are).
    element_ops: the elements those operations produce, summed: vector
      work per block.
    block_input_elements: elements of the largest input block (``x``'s).
    by_primitive: ``{primitive: element_ops}``.
    in_branch: the call sits in a branch of a conditional (a fallback).
  """
  name: str
  ops: int
  element_ops: int
  block_input_elements: int
  by_primitive: dict
  in_branch: bool = False

  @property
  def per_input_element(self) -> float:
    """Element operations per input element (roughly the work per byte
    read)."""
    return self.element_ops / max(1, self.block_input_elements)


def _kernel_name(body) -> str:
  """The kernel's name, from its body's debug info (``"name at file:line"``,
  the function Pallas traced), else ``"kernel"``."""
  info = getattr(getattr(body, "debug_info", None), "func_src_info", None)
  return str(info).split(" at ")[0] if info else "kernel"


def kernel_ops(fn, *args) -> list[KernelOps]:
  """Counts the operations of each ``pallas_call`` in ``fn(*args)`` (traced
  with ``jax.make_jaxpr``; call the kernels with ``interpret=True`` so that
  they appear as ``pallas_call`` with their body's jaxpr)."""

  def calls(jaxpr, branch=False):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        yield eqn, branch
      inner = branch or eqn.primitive.name == "cond"
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        yield from calls(sub, inner)

  def count(jaxpr, by):
    n = 0
    for eqn in jaxpr.eqns:
      subs = list(jax.extend.core.jaxprs_in_params(eqn.params))
      if eqn.primitive.name not in ("jit", "pjit") or not subs:
        n += 1
        by[eqn.primitive.name] += sum(
            math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)
      for sub in subs:
        n += count(sub, by)
    return n

  out = []
  for eqn, branch in calls(jax.make_jaxpr(fn)(*args).jaxpr):
    body, = jax.extend.core.jaxprs_in_params(eqn.params)
    by = collections.Counter()
    ops = count(body, by)
    # The body's first refs are the inputs' blocks (scalar-prefetch operands
    # whole, then one block per input), one per operand of the call.
    size = max(math.prod(getattr(v.aval, "shape", ()))
               for v in body.invars[:len(eqn.invars)])
    out.append(KernelOps(name=_kernel_name(body), ops=ops,
                         element_ops=sum(by.values()),
                         block_input_elements=size, by_primitive=dict(by),
                         in_branch=branch))
  return out


# An enum attribute's text in the pre-0.11 form, ``#gpu<dim x>``, and the
# same bytes in the form JAX 0.11's MLIR parses, ``#gpu.dim<x>``.
_OLD_ENUM_ATTR_RE = re.compile(rb"#(gpu|nvvm)<(\w+) (\w+)>")
_NEW_ENUM_ATTR = rb"#\1.\2<\3>"


def _parse_kernel_module(bytecode: bytes) -> ir.Module:
  """The Mosaic GPU kernel module serialized in a custom call's
  ``backend_config`` (MLIR bytecode), parsed in the current context.

  JAX 0.11 writes the gpu / nvvm enum attributes that its bytecode holds as
  text (``#gpu<dim x>``: the thread and block ids' dimension) in the form
  older MLIR printed, which its own MLIR no longer parses (``expected
  '<'``); JAX 0.10 and 0.12 parse as written. Where parsing fails, the
  module is parsed again with those attributes respelled ``#gpu.dim<x>``,
  the same number of bytes, so that nothing else in the bytecode moves.

  Raises:
    jax.extend.mlir.ir.MLIRError: the bytecode does not parse either way.
  """
  try:
    return ir.Module.parse(bytecode)
  except ir.MLIRError:
    respelled = _OLD_ENUM_ATTR_RE.sub(_NEW_ENUM_ATTR, bytecode)
    if respelled == bytecode:
      raise
    return ir.Module.parse(respelled)


_CONSTANT_RE = re.compile(
    r'\s*(%\d+) = "?[\w.]*arith\.constant"?\(?\)?\s*\{value = (-?\d+) : \w+\}')


@dataclasses.dataclass
class KernelLaunch:
  """How one Mosaic GPU kernel is launched, read from its serialized module
  in the CUDA export (the ``gpu.launch`` inside the custom call's
  ``backend_config``).

  Attributes:
    grid: CUDA blocks, ``(x, y, z)``.
    threads: threads per block, ``(x, y, z)``.
    shared_bytes: dynamic shared memory per block, bytes (None where the
      launch does not take it as a constant).
    loops: ``scf.for`` loops in the kernel (a persistent grid's loop over
      its blocks is one).
  """
  grid: tuple
  threads: tuple
  shared_bytes: int | None
  loops: int


def kernel_launches(fn, *args) -> list[KernelLaunch]:
  """The launch of each Mosaic GPU kernel in ``jax.jit(fn)`` exported for
  CUDA with ``args`` (ShapeDtypeStructs); no GPU needed."""
  text = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
  ctx = jax_mlir.make_ir_context()
  ctx.allow_unregistered_dialects = True  # the kernel's stable_mosaic_gpu ops
  out = []
  with ctx:
    calls = []

    def walk(op):
      for region in op.regions:
        for block in region.blocks:
          for o in block.operations:
            if (o.operation.name == "stablehlo.custom_call" and "mosaic_gpu"
                in str(o.attributes["call_target_name"])):
              calls.append(o)
            walk(o.operation)

    # The module must outlive the operations collected from it.
    module = ir.Module.parse(text)
    walk(module.operation)
    for call in calls:
      body = str(_parse_kernel_module(
          call.attributes["mhlo.backend_config"]["module"].value_bytes))
      lines = body.splitlines()
      launch = next(l for l in lines if "gpu.launch" in l)
      operands = _VALUE_RE.findall(launch.split("(", 1)[1].split(")", 1)[0])
      consts = {}
      for line in lines:
        m = _CONSTANT_RE.match(line)
        if m:
          consts[m.group(1)] = int(m.group(2))
      # gpu.launch(token, gridX, gridY, gridZ, blockX, blockY, blockZ, smem)
      dims = [consts.get(v) for v in operands[1:8]]
      out.append(KernelLaunch(grid=tuple(dims[0:3]), threads=tuple(dims[3:6]),
                              shared_bytes=dims[6],
                              loops=sum("scf.for" in l for l in lines)))
  return out

"""jaxcomp's API reference, generated from the modules' public names.

At every build this extension writes one page per module named in
``conf.py``'s ``jaxcomp_api_modules`` into ``docs/api/generated/``:

* the public names of a module are its ``__all__`` if it has one; else the
  names it defines (functions, classes, assignments) and, for a package's
  ``__init__``, the names it imports from ``jaxcomp`` itself (a re-export),
  never a name with a leading underscore nor a submodule;
* an object is documented in full once, on the page of the first module in
  ``jaxcomp_api_modules`` that exports it (``jaxcomp`` first, as Optax
  documents ``optax.adam``); every other module exporting it gets a short
  entry that links there;
* the fields of a ``NamedTuple`` (an optimizer state, a statistics record)
  are listed from the source comments beside them (``count: jax.Array  #
  shape=(), int32``), the project's habit for documenting state;
* a cross-reference to an object through a private path
  (``jaxcomp.compressors.base.Compressor``, as type hints produce) resolves
  to the page documenting that object.

So renaming or moving a private module needs no edit here: the pages follow
the public names.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pathlib
import pkgutil
import re
import types

# id(object) -> (documented full name, Sphinx py object type); filled when
# the pages are written, read when a reference is missing.
_DOCUMENTED: dict[int, tuple[str, str]] = {}
_FIELD_DOC_PREFIX = "Alias for field number"


def _source_tree(module):
  path = inspect.getsourcefile(module)
  return ast.parse(pathlib.Path(path).read_text()), path


def public_names(module) -> list[str]:
  """The public names of ``module``, in source order."""
  if hasattr(module, "__all__"):
    return list(module.__all__)
  tree, path = _source_tree(module)
  is_package = path.endswith("__init__.py")
  names = []

  def add(name):
    if name.startswith("_") or name in names:
      return
    obj = getattr(module, name, None)
    if obj is None or isinstance(obj, types.ModuleType):
      return
    names.append(name)

  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      add(node.name)
    elif isinstance(node, ast.Assign):
      for target in node.targets:
        if isinstance(target, ast.Name):
          add(target.id)
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
      add(node.target.id)
    elif (is_package and isinstance(node, ast.ImportFrom) and node.module
          and node.module.split(".")[0] == "jaxcomp"):
      for alias in node.names:
        add(alias.asname or alias.name)
  return names


def _kind(obj) -> str:
  if inspect.isclass(obj):
    return "class"
  if callable(obj):
    return "function"
  return "data"


def _signature(obj) -> str:
  """``(a, b=1, *, c)``: the signature without annotations."""
  try:
    sig = inspect.signature(obj)
  except (TypeError, ValueError):
    return "(...)"
  params = [p.replace(annotation=inspect.Parameter.empty)
            for p in sig.parameters.values()]
  return str(sig.replace(parameters=params,
                         return_annotation=inspect.Signature.empty))


def _summary(obj) -> str:
  doc = inspect.getdoc(obj) or ""
  first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
  if first.endswith("::"):  # an example follows in the docstring
    first = first[:-1]
  return first


def _data_comment(module, name) -> str | None:
  """The comment beside ``NAME = ...`` in the module's source, if any."""
  try:
    lines = inspect.getsource(module).splitlines()
  except (OSError, TypeError):
    return None
  for i, line in enumerate(lines):
    m = re.match(rf"^{re.escape(name)}\s*(:[^=]*)?=.*?#\s*(.*)$", line)
    if m:
      text = [m.group(2)]
      for more in lines[i + 1:]:
        c = re.match(r"^\s+#\s?(.*)$", more)
        if not c:
          break
        text.append(c.group(1))
      return " ".join(text)
  return None


def _rst_page(modname: str, documented_in: dict[int, str]) -> str:
  module = importlib.import_module(modname)
  title = f"``{modname}``"
  out = [title, "=" * len(title), "",
         f".. automodule:: {modname}", "   :no-members:", "", ""]
  names = public_names(module)
  rows = []
  entries = []
  for name in names:
    obj = getattr(module, name)
    full = f"{modname}.{name}"
    kind = _kind(obj)
    role = {"class": "class", "function": "func", "data": "data"}[kind]
    home = documented_in.get(id(obj)) if kind != "data" else None
    summary = (_summary(obj) if kind != "data"
               else _data_comment(module, name) or "")
    rows.append(f"   * - :{'py:' + role}:`{full}`\n"
                f"     - {_escape(summary)}")
    if home and home != full:
      directive = "py:class" if kind == "class" else "py:function"
      entries += [f".. {directive}:: {name}{_signature(obj)}",
                  f"   :module: {modname}", "",
                  f"   The same object as :py:{role}:`{home}`.", "", ""]
    elif kind == "class":
      entries += [f".. autoclass:: {full}", "   :members:", "", ""]
    elif kind == "function":
      entries += [f".. autofunction:: {full}", "", ""]
    else:
      comment = _data_comment(module, name)
      entries += [f".. autodata:: {full}"]
      if not isinstance(obj, (int, float, str, bool, tuple)) or len(repr(obj)) > 80:
        entries += ["   :no-value:"]
      entries += [""]
      if comment:
        entries += [f"   {_escape(comment)}", ""]
      entries += [""]
  if rows:
    out += [".. list-table::", "   :widths: 35 65", ""] + rows + ["", ""]
  return "\n".join(out + entries)


def _escape(text: str) -> str:
  """One line of docstring prose (rst roles kept) for a table cell."""
  return " ".join(text.split())


def _expand(modules):
  """``"pkg.*"`` stands for the public submodules of ``pkg``."""
  out = []
  for name in modules:
    if not name.endswith(".*"):
      out.append(name)
      continue
    package = importlib.import_module(name[:-2])
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
      if not info.name.rsplit(".", 1)[-1].startswith("_"):
        out.append(info.name)
  return out


def write_pages(app) -> None:
  modules = _expand(app.config.jaxcomp_api_modules)
  outdir = pathlib.Path(app.srcdir) / "api" / "generated"
  outdir.mkdir(parents=True, exist_ok=True)
  # Where each object is documented in full: the first module exporting it.
  documented_in: dict[int, str] = {}
  for modname in modules:
    module = importlib.import_module(modname)
    for name in public_names(module):
      obj = getattr(module, name)
      if _kind(obj) == "data":
        continue
      documented_in.setdefault(id(obj), f"{modname}.{name}")
      _DOCUMENTED.setdefault(id(obj), (f"{modname}.{name}", _kind(obj)))
      see = _SEE_RE.match(inspect.getdoc(obj) or "")
      real = _import(see.group(1)) if see else None
      if real is not None:  # a lazy wrapper: documented with real's docstring
        _DOCUMENTED.setdefault(id(real), (f"{modname}.{name}", _kind(obj)))
      if inspect.isclass(obj) and documented_in[id(obj)] == f"{modname}.{name}":
        for mname, member in vars(obj).items():
          if mname.startswith("_"):
            continue
          if isinstance(member, (classmethod, staticmethod)):
            member = member.__func__
          kind = "attribute" if isinstance(member, property) else "method"
          _DOCUMENTED.setdefault(id(member), (f"{modname}.{name}.{mname}", kind))
  written = set()
  for modname in modules:
    text = _rst_page(modname, documented_in)
    path = outdir / f"{modname}.rst"
    written.add(path.name)
    if not path.exists() or path.read_text() != text:  # keep mtimes: no rebuild
      path.write_text(text)
  for stale in outdir.glob("*.rst"):
    if stale.name not in written:
      stale.unlink()


def skip_member(app, what, name, obj, skip, options):
  """NamedTuple fields are listed from their source comments instead."""
  doc = getattr(obj, "__doc__", None) or ""
  if doc.startswith(_FIELD_DOC_PREFIX):
    return True
  return None


_FIELD_RE = re.compile(r"^\s+(\w+)\s*:\s*([^#=]+?)\s*(?:=\s*[^#]+?)?\s*(?:#\s?(.*))?$")


def _class_fields(cls, names) -> list[tuple[str, str, str]]:
  """``(name, type, comment)`` per field, from the class's source."""
  try:
    lines = inspect.getsource(cls).splitlines()
  except (OSError, TypeError):
    return []
  fields = set(names)
  out = []
  current = None
  for line in lines[1:]:
    m = _FIELD_RE.match(line)
    if m and m.group(1) in fields and current != m.group(1):
      current = m.group(1)
      out.append([current, m.group(2).strip(), (m.group(3) or "").strip()])
      continue
    c = re.match(r"^\s+#\s*(.*)$", line)
    if c and current is not None and out:
      out[-1][2] = (out[-1][2] + " " + c.group(1).strip()).strip()
      continue
    current = None
  return [tuple(f) for f in out]


_SEE_RE = re.compile(r"^See :func:`([\w.]+)`")


def _field_names(cls) -> list[str] | None:
  if isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields"):
    return list(cls._fields)
  if dataclasses.is_dataclass(cls):
    return [f.name for f in dataclasses.fields(cls)]
  return None


def _qualified(cls, annotation: str) -> str:
  """A field's type as the reference documents it: ``CompressedMeanState``
  written in a private module becomes ``jaxcomp.CompressedMeanState``, so
  the cross-reference has one target, not one per re-export."""
  obj = getattr(importlib.import_module(cls.__module__), annotation, None)
  if inspect.isclass(obj) and id(obj) in _DOCUMENTED:
    return _DOCUMENTED[id(obj)][0]
  return annotation


def process_docstring(app, what, name, obj, options, lines):
  """Runs before napoleon: lists the fields of a NamedTuple or dataclass
  from their source comments, expands "See :func:`x`" to x's docstring,
  and drops the docstring a constant inherits from its type (``int``)."""
  if what == "class" and inspect.isclass(obj):
    names = _field_names(obj)
    has_section = any(l.strip() in ("Attributes:", "Args:") for l in lines)
    if names and not has_section:
      fields = _class_fields(obj, names)
      if any(comment for _, _, comment in fields):
        lines += ["", "Attributes:"]
        for fname, ftype, comment in fields:
          lines.append(f"  {fname} ({_qualified(obj, ftype)}): {comment}")
        lines.append("")
  if what == "function" and lines and _SEE_RE.match(lines[0]):
    real = _import(_SEE_RE.match(lines[0]).group(1))
    if real is not None and inspect.getdoc(real):
      lines[:] = inspect.getdoc(real).splitlines() + [""]
  if what in ("data", "attribute") and lines and not inspect.isclass(obj) \
      and "\n".join(lines).strip() == (inspect.getdoc(type(obj)) or "").strip():
    lines[:] = []


def _import(dotted: str):
  parts = dotted.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    try:
      for attr in parts[i:]:
        obj = getattr(obj, attr)
    except AttributeError:
      return None
    return obj
  return None


def _candidates(node):
  """Objects a py reference may name, most specific first."""
  target = node.get("reftarget", "").lstrip("~.")
  modname = node.get("py:module") or ""
  clsname = node.get("py:class") or ""
  paths = []
  if target.startswith("jaxcomp"):
    paths.append(target)
  if modname and clsname:
    paths.append(f"{modname}.{clsname}.{target}")
    cls = _import(f"{modname}.{clsname}")
    if inspect.isclass(cls):
      paths.append(f"{cls.__module__}.{target}")
  if modname:
    paths.append(f"{modname}.{target}")
  for path in paths:
    obj = _import(path)
    if obj is not None:
      yield obj
  if "." not in target:  # a bare name: the one documented object of that name
    matches = {full for full, _ in _DOCUMENTED.values()
               if full.rsplit(".", 1)[-1] == target}
    if len(matches) == 1:
      yield _import(matches.pop())


_ROLES = {"class": "class", "function": "func", "data": "data",
          "method": "meth", "attribute": "attr", "module": "mod"}


def resolve_private_path(app, env, node, contnode):
  """Resolves a reference the py domain could not.

  To the page documenting the object when there is one (the object was
  named by a private path, or relative to the module that defines it);
  as unlinked text when the name is a real jaxcomp object or module that
  the reference does not document (a helper of a private module). A name
  that is no object at all stays unresolved: the build fails on it.
  """
  if node.get("refdomain") != "py":
    return None
  found = False
  for obj in _candidates(node):
    if obj is None:
      continue
    found = True
    if id(obj) not in _DOCUMENTED:
      continue
    full, kind = _DOCUMENTED[id(obj)]
    py = env.get_domain("py")
    newnode = node.deepcopy()
    newnode["reftarget"] = full
    resolved = py.resolve_xref(env, node["refdoc"], app.builder, _ROLES[kind],
                               full, newnode, contnode)
    if resolved is not None:
      return resolved
  if found:
    return contnode
  return None


def setup(app):
  app.add_config_value("jaxcomp_api_modules", [], "env")
  app.connect("builder-inited", write_pages)
  app.connect("autodoc-skip-member", skip_member)
  app.connect("autodoc-process-docstring", process_docstring, priority=400)
  app.connect("missing-reference", resolve_private_path)
  return {"parallel_read_safe": True, "parallel_write_safe": True}

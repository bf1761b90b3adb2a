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

* the modules come in groups, by task (``conf.py``'s ``jaxcomp_api_groups``),
  which ``docs/api/index.md`` lists where it says
  ``<!-- jaxcomp-api-groups -->``: each group's modules and the names of
  ``jaxcomp`` it covers (the sections of ``jaxcomp.__all__``, the comments
  between its names);
* a module whose ``__all__`` is written in sections (a comment before each
  run of names, as ``jaxcomp/__init__.py``'s) gets one heading per section;
* a paper cited as ``Author et al., Title <https://...>, year`` (the
  project's habit for references in docstrings) renders as a link on the
  title.

So renaming or moving a private module needs no edit here: the pages follow
the public names.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import io
import pathlib
import pkgutil
import re
import tokenize
import types
import warnings

# id(object) -> (documented full name, Sphinx py object type); filled when
# the pages are written, read when a reference is missing.
_DOCUMENTED: dict[int, tuple[str, str]] = {}
_FIELD_DOC_PREFIX = "Alias for field number"


def _get(module, name):
  """``module.name``, without the warning a deprecated module's names give
  (they are documented, not used)."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    return getattr(module, name)


def _all_sections(module) -> list[tuple[str, list[str]]]:
  """``[(title, names)]``: the comments that divide the module's
  ``__all__`` list into sections (``# The jax.jit idiom.`` before a run of
  names), or ``[]`` where it has none or a name outside every section."""
  try:
    source = inspect.getsource(module)
  except (OSError, TypeError):
    return []
  tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
  for i, tok in enumerate(tokens):
    if (tok.type == tokenize.NAME and tok.string == "__all__"
        and tok.start[1] == 0 and i + 2 < len(tokens)
        and tokens[i + 1].string == "=" and tokens[i + 2].string == "["):
      break
  else:
    return []
  sections: list[tuple[str, list[str]]] = []
  for tok in tokens[i + 3:]:
    if tok.string == "]":
      break
    if tok.type == tokenize.COMMENT:
      sections.append((tok.string.lstrip("#").strip().rstrip("."), []))
    elif tok.type == tokenize.STRING:
      if not sections:
        return []
      sections[-1][1].append(ast.literal_eval(tok.string))
  listed = [n for _, names in sections for n in names]
  if listed != list(getattr(module, "__all__", ())):
    return []
  return [(title, names) for title, names in sections if names]


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
    obj = _get(module, name) if hasattr(module, name) else None
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
  return link_references(literal_plurals(first))


def literal_plurals(text: str) -> str:
  """````jax.Array``s`` (a literal with a suffix, which reStructuredText
  does not end there) as ````jax.Array``\\ s``: the literal, then the
  suffix joined to it. Literals pair up from the left, as they do in
  reStructuredText, within a paragraph (one with an odd count is left as
  it is)."""
  paragraphs = re.split(r"(\n\s*\n)", text)
  for p, paragraph in enumerate(paragraphs):
    parts = paragraph.split("``")
    if len(parts) % 2 == 0:
      continue
    for i in range(2, len(parts), 2):  # the text after a closing ``
      if parts[i][:1].isalpha():
        parts[i] = "\\ " + parts[i]
    paragraphs[p] = "``".join(parts)
  return "".join(paragraphs)


# ``<https://...>`` not already the target of a link (`` `Title <url>`_ ``).
_URL_RE = re.compile(r"<(https?://[^\s<>`]+)>(?!`)")
# Where the authors of a citation end: "Lin et al., ", "Lin et al, ".
_ET_AL_RE = re.compile(r"\bet al\.?,\s+")
_SECTION_RE = re.compile(r"^\s*References?:\s*")


def _citation_start(text: str, end: int, floor: int) -> int:
  """Where the citation that ends at ``text[end]`` begins: after the last
  ``;``, unmatched ``(`` or blank line before it (not before ``floor``)."""
  depth = 0
  i = end - 1
  while i >= floor:
    c = text[i]
    if c == ")":
      depth += 1
    elif c == "(":
      if depth == 0:
        return i + 1
      depth -= 1
    elif c == ";" and depth == 0:
      return i + 1
    elif c == "\n" and not text[text.rfind("\n", 0, i) + 1:i].strip():
      return i + 1  # the line before is blank: a paragraph starts here
    i -= 1
  return floor


def _title_start(segment: str) -> int:
  """The offset of the title in a citation ``Authors, Title``: after
  ``et al.,``, after the comma that follows the last author of ``A, B &
  C``, or after a single author's comma; 0 where there is no author."""
  m = _ET_AL_RE.search(segment)
  if m:
    return m.end()
  amp = segment.find(" & ")
  comma = segment.find(", ", amp + 3 if amp >= 0 else 0)
  if comma < 0:
    return 0
  return comma + 2


def link_references(text: str) -> str:
  """``Author et al., Title <https://...>, year`` with the title made the
  link's text (an anonymous reStructuredText link, so that a page citing a
  paper twice has no duplicate target); the rest as it was. A URL already
  inside a link, or whose title holds inline markup, is left alone."""
  out, pos = [], 0
  for m in _URL_RE.finditer(text):
    start = _citation_start(text, m.start(), pos)
    segment = text[start:m.start()]
    lead = len(segment) - len(segment.lstrip())
    section = _SECTION_RE.match(segment[lead:])
    if section:
      lead += section.end()
    title_at = start + lead + _title_start(segment[lead:])
    title = text[title_at:m.start()].strip()
    if title.startswith("*") and title.endswith("*"):  # an emphasised title
      title = title.strip("*").strip()
    if not title or "`" in title or "*" in title or "<" in title:
      continue
    out += [text[pos:title_at], f"`{title} <{m.group(1)}>`__"]
    pos = m.end()
  out.append(text[pos:])
  return "".join(out)


def _data_comment(module, name) -> str | None:
  """The comment beside ``NAME = ...`` in the module's source, or, for a
  name the module imports (``from jaxcomp.pkg._mod import NAME``, a
  package's re-export), in the source of the module it comes from."""
  try:
    source = inspect.getsource(module)
  except (OSError, TypeError):
    return None
  lines = source.splitlines()
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
  for node in ast.parse(source).body:
    if (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
        and any(a.name == name and a.asname in (None, name)
                for a in node.names)):
      return _data_comment(importlib.import_module(node.module), name)
  return None


def _entries(module, modname: str, names, documented_in: dict[int, str]):
  """``(rows, entries)``: the summary table's rows and the reference
  entries of ``names`` of ``module``."""
  deprecated = (inspect.getdoc(module) or "").startswith("Deprecated")
  rows, entries = [], []
  for name in names:
    obj = _get(module, name)
    full = f"{modname}.{name}"
    kind = _kind(obj)
    role = {"class": "class", "function": "func", "data": "data"}[kind]
    home = documented_in.get(id(obj)) if kind != "data" else None
    summary = (_summary(obj) if kind != "data"
               else _data_comment(module, name) or "")
    if home and home != full and deprecated:
      summary = f"Deprecated: use :py:{role}:`{home}`."
    rows.append(f"   * - :{'py:' + role}:`{full}`\n"
                f"     - {_escape(summary)}")
    if home and home != full:
      directive = "py:class" if kind == "class" else "py:function"
      what = ("Deprecated: the same object as" if deprecated
              else "The same object as")
      entries += [f".. {directive}:: {name}{_signature(obj)}",
                  f"   :module: {modname}", "",
                  f"   {what} :py:{role}:`{home}`.", "", ""]
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
  return rows, entries


def _table(rows) -> list[str]:
  if not rows:
    return []
  return [".. list-table::", "   :widths: 35 65", ""] + rows + ["", ""]


def _rst_page(modname: str, documented_in: dict[int, str]) -> str:
  module = importlib.import_module(modname)
  title = f"``{modname}``"
  out = [title, "=" * len(title), "",
         f".. automodule:: {modname}", "   :no-members:", "", ""]
  sections = _all_sections(module)
  if not sections:  # one table, then the entries
    rows, entries = _entries(module, modname, public_names(module),
                             documented_in)
    return "\n".join(out + _table(rows) + entries)
  for heading, names in sections:  # per section: a heading, a table, entries
    rows, entries = _entries(module, modname, names, documented_in)
    out += [heading, "-" * len(heading), ""] + _table(rows) + entries
  return "\n".join(out)


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


def api_modules(config) -> list[str]:
  """The modules of the reference, in order: ``jaxcomp_api_groups``'
  (``pkg.*`` expanded), else ``jaxcomp_api_modules``."""
  groups = getattr(config, "jaxcomp_api_groups", None)
  if groups:
    return _expand([m for group in groups for m in group["modules"]])
  return _expand(config.jaxcomp_api_modules)


def write_pages(app) -> None:
  modules = api_modules(app.config)
  outdir = pathlib.Path(app.srcdir) / "api" / "generated"
  outdir.mkdir(parents=True, exist_ok=True)
  # Where each object is documented in full: the first module exporting it.
  documented_in: dict[int, str] = {}
  for modname in modules:
    module = importlib.import_module(modname)
    for name in public_names(module):
      obj = _get(module, name)
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
  _name_raised_types(lines)
  text = "\n".join(lines)
  fixed = link_references(literal_plurals(text))
  if fixed != text:
    lines[:] = fixed.split("\n")


_RAISES_ENTRY_RE = re.compile(r"^\s*[\w.]+(\s*\([^)]*\))?(\s*,\s*[\w.]+)*\s*:")


def _name_raised_types(lines: list[str]) -> None:
  """An entry of a ``Raises:`` section that names no exception type
  (``Whatever compiling fn raises.``) gets ``Exception:`` before it, so
  that napoleon does not take its words for a type to cross-reference."""
  section = None  # the indentation of the Raises: header while in it
  entry = None  # the indentation of its entries
  for i, line in enumerate(lines):
    indent = len(line) - len(line.lstrip())
    if line.strip() == "Raises:":
      section, entry = indent, None
      continue
    if section is None or not line.strip():
      continue
    if indent <= section:
      section = None
      continue
    if entry is None:
      entry = indent
    if indent == entry and not _RAISES_ENTRY_RE.match(line):
      lines[i] = line[:indent] + "Exception: " + line[indent:]


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


GROUPS_MARKER = "<!-- jaxcomp-api-groups -->"


def groups_markdown(config) -> str:
  """``docs/api/index.md``'s sections: per group of ``jaxcomp_api_groups``,
  its title, what it is for, the names of ``jaxcomp`` it covers and a
  table of contents of its modules' pages."""
  import jaxcomp
  sections = dict(_all_sections(jaxcomp))
  out = []
  for group in config.jaxcomp_api_groups:
    out += [f"## {group['title']}", "", group["about"], ""]
    names = []
    for title in group.get("sections", ()):
      if title not in sections:
        raise ValueError(f"jaxcomp_api_groups: {group['title']!r} names the "
                         f"section {title!r}, which jaxcomp.__all__ lacks "
                         f"(it has {sorted(sections)})")
      names += sections[title]
    if names:
      out += ["In `jaxcomp`: " + ", ".join(
          f"{{py:obj}}`jaxcomp.{n}`" for n in names) + ".", ""]
    modules = _expand(group["modules"])
    out += ["```{eval-rst}", ".. list-table::", "   :widths: 35 65", ""]
    for m in modules:
      summary = _escape(_summary(importlib.import_module(m)))
      out += [f"   * - :py:mod:`{m}`", f"     - {summary}"]
    out += ["```", "", "```{toctree}", ":hidden:", ""]
    out += [f"generated/{m}" for m in modules]
    out += ["```", ""]
  return "\n".join(out)


def fill_api_index(app, docname, source):
  """Puts the groups into ``api/index`` where it has the marker."""
  if docname == "api/index" and GROUPS_MARKER in source[0]:
    source[0] = source[0].replace(GROUPS_MARKER,
                                  groups_markdown(app.config))


def setup(app):
  app.add_config_value("jaxcomp_api_modules", [], "env")
  app.add_config_value("jaxcomp_api_groups", [], "env")
  app.connect("builder-inited", write_pages)
  app.connect("source-read", fill_api_index)
  app.connect("autodoc-skip-member", skip_member)
  app.connect("autodoc-process-docstring", process_docstring, priority=400)
  app.connect("missing-reference", resolve_private_path)
  return {"parallel_read_safe": True, "parallel_write_safe": True}

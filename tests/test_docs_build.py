"""The documentation site builds with warnings as errors, and its API
reference has an entry for every public name.

The same build by hand (``docs`` or ``test`` extra):

    sphinx-build -W --keep-going -b html docs docs/_build/html
"""

import importlib
import inspect
import pathlib
import subprocess
import sys
import types
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]


def build_site(out):
  build = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-E",
       "-b", "html", "-d", str(out / "doctrees"), "docs", str(out / "html")],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  # -W turns every warning into an error: a broken cross-reference to a
  # jaxcomp name, a link to a missing page or anchor, a docstring that is
  # not valid reStructuredText, a page outside every toctree.
  assert build.returncode == 0, build.stderr[-6000:]


def _inventory(site):
  from sphinx.util.inventory import InventoryFile
  with open(site / "html" / "objects.inv", "rb") as f:
    inv = InventoryFile.load(f, "", lambda base, uri: uri)
  names = set()
  for kind, entries in inv.items():
    if kind.startswith("py:"):
      names |= set(entries)
  return names


def _api_groups():
  """docs/conf.py's ``jaxcomp_api_groups``."""
  import ast
  conf = ast.parse((ROOT / "docs" / "conf.py").read_text())
  return next(ast.literal_eval(node.value) for node in conf.body
              if isinstance(node, ast.Assign)
              and getattr(node.targets[0], "id", "") == "jaxcomp_api_groups")


def _extension():
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "jaxcomp_api", ROOT / "docs" / "_ext" / "jaxcomp_api.py")
  ext = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(ext)
  return ext


def _api_modules():
  """The modules of docs/conf.py's ``jaxcomp_api_groups``, in order, with
  ``pkg.*`` expanded as the docs build expands it."""
  return _extension()._expand([m for group in _api_groups()
                               for m in group["modules"]])


def _public_functions_and_classes(modname):
  """Functions and classes a user reaches as ``modname.name``: for a
  package, whatever of jaxcomp it holds without a leading underscore; for a
  module, what it defines itself. (Judged from the objects, independently
  of how docs/_ext/jaxcomp_api.py lists them.)"""
  module = importlib.import_module(modname)
  is_package = hasattr(module, "__path__")
  names = getattr(module, "__all__", None)
  out = []
  for name in names or dir(module):
    if name.startswith("_"):
      continue
    with warnings.catch_warnings():  # a deprecated module's names warn
      warnings.simplefilter("ignore", DeprecationWarning)
      obj = getattr(module, name)
    if isinstance(obj, types.ModuleType):
      continue
    if not (inspect.isclass(obj) or inspect.isfunction(obj)):
      continue
    origin = getattr(obj, "__module__", "") or ""
    if names or (origin.startswith("jaxcomp") if is_package else origin == modname):
      out.append(name)
  return out


def test_site_builds_with_warnings_as_errors_and_documents_every_name(tmp_path):
  # One test, one build (about 20 s of CPU): its checks follow in turn.
  site = tmp_path
  build_site(site)
  html = site / "html"
  for page in ["index", "getting_started", "which_compressor", "training_loop",
               "sharded", "lowcomm", "multihost", "compressors", "design",
               "collectives", "perfmodel", "fashion_mnist", "convergence",
               "fsdp_results", "lowcomm_results", "real_links",
               "perfmodel_results", "vs_pytorch", "kernels", "codec_speed",
               "gpu",
               "changelog", "api/index", "api/generated/jaxcomp"]:
    assert (html / f"{page}.html").is_file(), page
  # The plots are on the pages, not only next to them.
  for png in ["perfmodel_validation.png", "convergence.png",
              "convergence_lowcomm.png", "perfmodel_whatif_resnet50.png",
              "which_compressor_llama.png"]:
    assert (html / "_images" / png).is_file(), png
  _check_every_public_name_has_a_reference_entry(site)
  _check_reference_is_grouped_by_task(html)
  _check_pages_read_in_a_browser(html)


def _text(page):
  """A built page's text, tags dropped."""
  import html as html_lib
  import re
  return html_lib.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


def _check_reference_is_grouped_by_task(html):
  """docs/api/index.md lists the modules by task, in conf.py's groups, and
  jaxcomp's page follows jaxcomp.__all__: its sections (the comments in
  jaxcomp/__init__.py) and their names in order."""
  import jaxcomp
  index = (html / "api" / "index.html").read_text()
  at = 0
  for group in _api_groups():
    at = index.index(f">{group['title']}<", at)
    for modname in _extension()._expand(group["modules"]):
      assert f"generated/{modname}.html" in index[at:], modname
  for title in ["Transforms", "Compressors", "Steps and layouts",
                "Low-communication training", "FSDP", "Flax",
                "Checkpoints and multi-host", "Kernels and autotuning"]:
    assert any(g["title"] == title for g in _api_groups()), title
  sections = _extension()._all_sections(jaxcomp)
  assert [n for _, names in sections for n in names] == jaxcomp.__all__
  page = (html / "api" / "generated" / "jaxcomp.html").read_text()
  at = 0
  for title, names in sections:
    at = page.index(f">{title}<", at)
    for name in names:  # each entry in __all__'s order
      at = page.index(f'id="jaxcomp.{name}"', at)


def _check_pages_read_in_a_browser(html):
  import re
  for page in sorted(html.rglob("*.html")):
    text = page.read_text()
    # A citation ``Title <https://...>`` renders as a link on the title,
    # not as the URL between angle brackets.
    assert not re.search(r"&lt;<a class=\"reference external\"", text), page
  # A command in a docstring is a code block, not a definition list.
  launch = (html / "api" / "generated" / "jaxcomp.launch.html").read_text()
  assert '<dl class="simple">' not in launch
  assert "jaxcomp launch -n 2 --devices-per-process 2" in _text(
      html / "api" / "generated" / "jaxcomp.launch.html")
  # Real signatures, not a wrapper's (*args, **kwargs).
  flax_page = _text(html / "api" / "generated" / "jaxcomp.flax.html")
  assert "Optimizer(*args" not in flax_page
  assert re.search(r"Optimizer\(model, tx[^,]*, \*, wrt, mesh", flax_page)


# Public modules (no leading underscore) of jaxcomp that have no API page of
# their own, and why. A new module must be added to docs/conf.py's
# jaxcomp_api_modules or here.
NOT_IN_REFERENCE = {
    "cli": "the `jaxcomp` command; `jaxcomp --help` and each subcommand's "
           "--help document it",
    "hlo": "a package; jaxcomp.hlo.traffic is listed",
    "elastic.*": "the islands of the optional elastic extra (torch, "
                 "torchft): docs/lowcomm.md's \"Elastic islands\" documents "
                 "them, `jaxcomp islands --help` the launcher",
    "hlo.kernel_structure": "the kernel tests' reader of exported "
                            "StableHLO, not a training API",
}


def test_every_public_module_is_in_the_reference_or_excluded_on_purpose():
  """A public module (no leading underscore in any part of its name) has a
  page, or is a submodule of a package with a page (the package's page
  documents what it exports: jaxcomp.compressors.topk's TopK as
  jaxcomp.compressors.TopK), or NOT_IN_REFERENCE says why it has none."""
  import pkgutil
  import jaxcomp
  listed = set(_api_modules())
  for info in pkgutil.walk_packages(jaxcomp.__path__, "jaxcomp."):
    parts = info.name.split(".")
    if any(p.startswith("_") for p in parts):
      continue
    short = info.name.removeprefix("jaxcomp.")
    covered = any(".".join(parts[:i]) in listed for i in range(2, len(parts)))
    # "pkg.*" excludes pkg and its submodules; "pkg" the package alone.
    excluded = short in NOT_IN_REFERENCE or any(
        ".".join(parts[1:i]) + ".*" in NOT_IN_REFERENCE
        for i in range(2, len(parts) + 1))
    assert info.name in listed or covered or excluded, (
        f"{info.name} is public: list it in docs/conf.py's "
        f"jaxcomp_api_groups or say in NOT_IN_REFERENCE why it has no page "
        f"({short!r})")


def _check_every_public_name_has_a_reference_entry(site):
  documented = _inventory(site)
  modules = _api_modules()
  for required in ["jaxcomp", "jaxcomp.fsdp", "jaxcomp.lowcomm", "jaxcomp.flax",
                   "jaxcomp.perfmodel", "jaxcomp.checkpoint",
                   "jaxcomp.distributed", "jaxcomp.compressors",
                   "jaxcomp.collectives", "jaxcomp.feedback",
                   "jaxcomp.bucketing"]:
    assert required in modules, required
  missing = []
  for modname in modules:
    assert modname in documented, modname
    for name in _public_functions_and_classes(modname):
      if f"{modname}.{name}" not in documented:
        missing.append(f"{modname}.{name}")
  assert not missing, missing
  # DiLoCo and DeMo, by the names users call them.
  for name in ["jaxcomp.diloco", "jaxcomp.demo", "jaxcomp.lowcomm.diloco",
               "jaxcomp.lowcomm.demo", "jaxcomp.compressed_mean",
               "jaxcomp.CompressionStats.bytes_sent"]:
    assert name in documented, name


def test_public_classes_show_their_constructors_signature():
  """``help()``, IDEs and the reference show a class's real parameters,
  not the ``(*args, **kwargs)`` of a metaclass that calls ``__init__``
  (Flax NNX's object metaclass)."""
  import jaxcomp.flax
  params = inspect.signature(jaxcomp.flax.Optimizer).parameters
  assert list(params)[:4] == ["model", "tx", "wrt", "mesh"], params
  assert "self" not in params and "args" not in params
  assert params["wrt"].kind is inspect.Parameter.KEYWORD_ONLY
  for modname in _api_modules():
    module = importlib.import_module(modname)
    for name in _public_functions_and_classes(modname):
      with warnings.catch_warnings():  # a deprecated module's names warn
        warnings.simplefilter("ignore", DeprecationWarning)
        obj = getattr(module, name)
      if not inspect.isclass(obj) or name in _WRAPPED_SIGNATURES:
        continue
      try:
        params = inspect.signature(obj).parameters
      except (TypeError, ValueError):  # a builtin's (an exception class)
        continue
      kinds = [p.kind for p in params.values()]
      assert kinds != [inspect.Parameter.VAR_POSITIONAL,
                       inspect.Parameter.VAR_KEYWORD], f"{modname}.{name}"


# Public classes whose signature reads (*args, **kwargs), and why.
_WRAPPED_SIGNATURES = {
    "PricedCompressor": "jaxcomp.perfmodel's Protocol (typing gives a "
                        "Protocol no constructor); it is not instantiated",
}


def test_the_reference_reads_docstrings_as_they_are_written():
  """docs/_ext/jaxcomp_api.py's fixes of the project's docstring habits
  that reStructuredText reads otherwise (unit checks; the build checks
  the pages)."""
  ext = _extension()
  # A citation: the title is the link (after "et al.," or the last author).
  assert ext.link_references(
      "Lin et al., Deep Gradient Compression <https://arxiv.org/abs/1712.01887>"
      ", 2018") == ("Lin et al., `Deep Gradient Compression "
                    "<https://arxiv.org/abs/1712.01887>`__, 2018")
  assert ext.link_references(
      "(Peng, Quesnelle & Kingma, DeMo: Decoupled\n  Momentum Optimization "
      "<https://arxiv.org/abs/2411.19870>, 2024)") == (
      "(Peng, Quesnelle & Kingma, `DeMo: Decoupled\n  Momentum Optimization "
      "<https://arxiv.org/abs/2411.19870>`__, 2024)")
  done = "see `the paper <https://example.org>`_"  # already a link
  assert ext.link_references(done) == done
  # A literal with a suffix: ``jax.Array``s.
  assert ext.literal_plurals("``jax.Array``s and ``x``, ``y``") == (
      "``jax.Array``\\ s and ``x``, ``y``")
  # A Raises entry without a type.
  lines = ["Raises:", "  Whatever ``fn`` raises.", "  ValueError: a bad x."]
  ext._name_raised_types(lines)
  assert lines[1:] == ["  Exception: Whatever ``fn`` raises.",
                       "  ValueError: a bad x."]

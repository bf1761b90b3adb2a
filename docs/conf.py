"""Sphinx configuration of jaxcomp's documentation site.

Build it (``docs`` or ``test`` extra installed):

    sphinx-build -W --keep-going -b html docs docs/_build/html
    python -m http.server -d docs/_build/html 8000

``tests/test_docs_build.py`` runs the same build in CI, warnings as errors.
"""

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

# The docstrings' doctests assume the test suite's 8 simulated CPU devices;
# importing the library for autodoc runs no JAX computation, but keep the
# platform the same so that nothing reaches for an accelerator.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxcomp  # noqa: E402

project = "jaxcomp"
author = "the jaxcomp authors"
release = jaxcomp.__version__
version = release
copyright = "the jaxcomp authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "jaxcomp_api",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "api/generated/_*", "**/.ipynb_checkpoints"]

# Markdown (MyST): `#heading-anchor` links, ::: fences, $math$.
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3

# Warnings are errors in CI (-W): every cross-reference must resolve. The
# references into other libraries (JAX, Optax, Flax, NumPy, Orbax, the
# standard library) are not checked: the build runs offline, without their
# intersphinx inventories.
nitpicky = True
_EXTERNAL = (r"(jax|jaxlib|optax|flax|nnx|numpy|np|orbax|ocp|typing|"
             r"collections|abc|argparse|concurrent|dataclasses|enum|os|"
             r"pathlib|subprocess|types|builtins|chex|jnp|lax|P|Mesh|"
             r"NamedSharding|PartitionSpec)(\..*)?")
nitpick_ignore_regex = [
    (r"py:.*", _EXTERNAL),
    (r"py:.*", r"(int|float|str|bool|bytes|dict|list|tuple|set|frozenset|"
               r"object|type|None|Any|Callable|Sequence|Mapping|Iterable|"
               r"Iterator|NamedTuple|Optional|Union|Literal|ClassVar|"
               r"Protocol|Generic|TypeVar|T|Self|ArrayLike|Array|PyTree|"
               r"Exception|ValueError|TypeError|RuntimeError|KeyError|"
               r"NameError|FileNotFoundError|Ellipsis|EllipsisType|"
               r"GradientTransformation|GradientTransformationExtraArgs|"
               r"Params|Updates|OptState)"),
]

autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_default_options = {"show-inheritance": True}
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = False
napoleon_custom_sections = [("Class attributes", "params_style")]

# The API reference: one page per module, each listing the module's public
# names (its __all__, else what it defines or, for a package, re-exports
# from jaxcomp without a leading underscore). docs/_ext/jaxcomp_api.py
# writes the pages into docs/api/generated/ at every build.
jaxcomp_api_modules = [
    "jaxcomp",
    "jaxcomp.steps",
    "jaxcomp.jit",
    "jaxcomp.compressors",
    "jaxcomp.collectives",
    "jaxcomp.feedback",
    "jaxcomp.bucketing",
    "jaxcomp.fsdp",
    "jaxcomp.combinators",
    "jaxcomp.transform",
    "jaxcomp.lowcomm",
    "jaxcomp.flax",
    "jaxcomp.perfmodel",
    "jaxcomp.checkpoint",
    "jaxcomp.distributed",
    "jaxcomp.launch",
    "jaxcomp.wire",
    "jaxcomp.inspect.traffic",
    "jaxcomp.kernels.*",
]

html_theme = "furo"
html_title = f"jaxcomp {release}"
html_static_path = []
html_show_sourcelink = True
pygments_style = "sphinx"
pygments_dark_style = "monokai"

# "More than one target found" (ref.python): autodoc records a class under
# its canonical private path too (jaxcomp.transform._compressed_mean.
# CompressedMeanState beside jaxcomp.CompressedMeanState), so a bare type
# name has several targets that are one object. A missing target (ref.class,
# ref.func, ...) still fails the build.
suppress_warnings = ["ref.python"]

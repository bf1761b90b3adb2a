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
               r"Params|Updates|OptState|AxisName)"),
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

# The API reference, grouped by task as Optax's is: one page per module,
# each listing the module's public names (its __all__, else what it defines
# or, for a package, re-exports from jaxcomp without a leading underscore).
# docs/_ext/jaxcomp_api.py writes the pages into docs/api/generated/ at
# every build, and docs/api/index.md's sections from these groups: a
# group's title, what it is for, its modules (``pkg.*``: the public
# submodules of pkg) and the sections of jaxcomp's __all__ (the comments
# in jaxcomp/__init__.py) whose names it lists. An object is documented in
# full on the page of the first module, in this order, that exports it.
jaxcomp_api_groups = [
    {"title": "The jaxcomp namespace",
     "about": "What ``import jaxcomp`` gives: the names most training code "
              "uses, on one page, in the order of ``jaxcomp.__all__``.",
     "modules": ["jaxcomp"]},
    {"title": "Transforms",
     "about": "The compressed mean, an Optax gradient transformation, its "
              "state and statistics, and the combinators around it.",
     "sections": ["The transform and its state", "Combinators around it"],
     "modules": ["jaxcomp.transform", "jaxcomp.combinators"]},
    {"title": "Compressors",
     "about": "The four parts of a compressed exchange: what is sent "
              "(compressors), how it travels (collectives), what happens "
              "to what was not sent (feedback) and which tensors go "
              "together (bucketing).",
     "modules": ["jaxcomp.compressors", "jaxcomp.collectives",
                 "jaxcomp.feedback", "jaxcomp.bucketing"]},
    {"title": "Steps and layouts",
     "about": "The train step under ``jax.shard_map``: one init and one "
              "step builder passing a ``TrainState``, the layouts of the "
              "parameters, the step body and the state placement they "
              "are built of, and the ``jax.jit`` (GSPMD) route.",
     "sections": ["A shard_map train step: one init, one step builder, "
                  "the layouts", "A jax.jit (GSPMD) step"],
     "modules": ["jaxcomp.train", "jaxcomp.layouts", "jaxcomp.steps",
                 "jaxcomp.placement", "jaxcomp.gspmd"]},
    {"title": "Low-communication training",
     "about": "DiLoCo (with Streaming DiLoCo's fragments and compressed "
              "pseudo-gradients) and DeMo.",
     "sections": ["Low-communication training"],
     "modules": ["jaxcomp.lowcomm"]},
    {"title": "Compressed optimizers",
     "about": "DeepSpeed's compressed optimizers as Optax transformations "
              "that own their exchange: 1-bit Adam, 0/1 Adam and 1-bit "
              "LAMB, with the bytes of each phase.",
     "sections": ["Compressed optimizers"],
     "modules": ["jaxcomp.optimizers"]},
    {"title": "FSDP",
     "about": "Parameters in flat shards over the data axis (ZeRO-3, HSDP), "
              "with a compressed reduce-scatter of the gradient and an "
              "optionally quantized all-gather of the parameters.",
     "modules": ["jaxcomp.fsdp"]},
    {"title": "Flax",
     "about": "Flax NNX's ``Optimizer`` and train step, and Linen's "
              "``TrainState``, with the optimizer state placed per device.",
     "modules": ["jaxcomp.flax"]},
    {"title": "Checkpoints and multi-host",
     "about": "Orbax checkpoints of the placed state, multi-process jobs "
              "(start-up, agreement, peer watching) and a local launcher.",
     "modules": ["jaxcomp.checkpoint", "jaxcomp.distributed",
                 "jaxcomp.launch"]},
    {"title": "The performance model and traffic",
     "about": "Whether compression pays for a model and a network "
              "(``jaxcomp whatif``), the bytes each collective sends, and "
              "what a compiled step really sends.",
     "sections": ["Reading a compiled step"],
     "modules": ["jaxcomp.perfmodel", "jaxcomp.wire",
                 "jaxcomp.hlo.traffic"]},
    {"title": "Kernels and autotuning",
     "about": "Pallas (Mosaic GPU) kernels of the compressors, their XLA "
              "references, and the autotuner that picks one per op and "
              "size on NVIDIA GPUs.",
     "modules": ["jaxcomp.kernels", "jaxcomp.kernels.*", "jaxcomp.autotune"]},
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

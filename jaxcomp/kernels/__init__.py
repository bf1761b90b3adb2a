"""Pallas (Mosaic GPU) kernels of the compressors and their XLA references.

One module per op, each holding its Pallas kernel, its jitted wrapper, its
``*_reference`` (plain ``jnp``, the XLA path) and its ``*_auto`` dispatch:
:mod:`~jaxcomp.kernels.sign`, :mod:`~jaxcomp.kernels.qsgd`,
:mod:`~jaxcomp.kernels.int8_block`, :mod:`~jaxcomp.kernels.fp8_block` and
:mod:`~jaxcomp.kernels.topk`; what the quantizers share (per-group
statistics, :class:`QuantizeConfig`: ``_blocks``; the Mosaic GPU kernel's
layout and launch: ``_blocks_mosaic``) is private, as are top-k's parts
(``_topk_select``, ``_topk_mosaic``, ``_topk_triton``, re-exported by
``topk``). The int8 and fp8 blocks' ``pallas`` path is a
kernel lowered by Triton (``_triton``: one masked pass, measured 1.7x faster
than XLA and 4x faster than the Mosaic GPU kernel on an H200) for block
sizes that are powers of two (:func:`triton_supported_block`); top-k has a
Triton-lowered compaction too (``topk.topk_triton``, ``_topk_triton``), and
sign packing and QSGD Triton kernels (``sign.sign_pack_triton``,
``qsgd.qsgd_quantize_triton``): candidates of the autotuner. The dispatch
takes Triton kernels only where Pallas' Triton backend is present and lowers
without a warning (``_triton.available``: before JAX 0.12); elsewhere it
falls back to the XLA path (and the Mosaic GPU kernels), and jaxcomp
imports without the backend. Beside them:
the selection primitive
(:mod:`~jaxcomp.kernels.compact`), bit packing and counter-based random
numbers. ``implementation=None`` picks the fastest of the XLA path, the
Mosaic GPU kernel and the Triton kernel (``CANDIDATES``) per op, dtype
and size by measurement on NVIDIA GPUs (:func:`autotune`,
:class:`Autotuner`; XLA elsewhere). The launch framework is private
(``_launch``). This package imports nothing else of jaxcomp but
``jaxcomp._jaxcompat`` (the JAX spellings that moved between releases).
"""

from jaxcomp.kernels._autotune import Autotuner
from jaxcomp.kernels._autotune_cache import CANDIDATES
from jaxcomp.kernels._autotune_cache import Decision
from jaxcomp.kernels._autotune_cache import ENV_CACHE
from jaxcomp.kernels._autotune import ENV_KERNELS
from jaxcomp.kernels._autotune_cache import IMPLEMENTATIONS
from jaxcomp.kernels._autotune_cache import TuneKey
from jaxcomp.kernels._autotune import autotune
from jaxcomp.kernels._autotune import default_autotuner
from jaxcomp.kernels._autotune import measure_seconds
from jaxcomp.kernels._autotune import resolve_implementation
from jaxcomp.kernels._autotune import use_autotuner
from jaxcomp.kernels._launch import Interpret
from jaxcomp.kernels._blocks import QuantizeConfig
from jaxcomp.kernels._blocks import group_reduce
from jaxcomp.kernels._blocks import per_element
from jaxcomp.kernels._launch import nvidia_gpu
from jaxcomp.kernels._triton import supported_block as triton_supported_block

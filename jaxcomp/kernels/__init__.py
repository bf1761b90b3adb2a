"""Pallas (Mosaic GPU) kernels of the compressors and their XLA references.

One module per op family (:mod:`~jaxcomp.kernels.quantize`,
:mod:`~jaxcomp.kernels.topk`), the selection primitive
(:mod:`~jaxcomp.kernels.compact`), bit packing and counter-based random
numbers; the launch framework is private (``_launch``). This package imports
nothing else of jaxcomp.
"""

from jaxcomp.kernels._autotune import IMPLEMENTATIONS
from jaxcomp.kernels._autotune import resolve_implementation
from jaxcomp.kernels._launch import Interpret
from jaxcomp.kernels._launch import nvidia_gpu

"""Pallas (Mosaic GPU) kernels of the compressors and their XLA references.

One module per op family (:mod:`~jaxcomp.kernels.quantize`,
:mod:`~jaxcomp.kernels.topk`), the selection primitive
(:mod:`~jaxcomp.kernels.compact`), bit packing and counter-based random
numbers. ``implementation=None`` picks the Pallas kernel or the XLA path per
op and size by measurement on NVIDIA GPUs (:func:`autotune`,
:class:`Autotuner`; XLA elsewhere). The launch framework is private
(``_launch``). This package imports nothing else of jaxcomp but
``jaxcomp._jaxcompat`` (the JAX spellings that moved between releases).
"""

from jaxcomp.kernels._autotune import Autotuner
from jaxcomp.kernels._autotune import Decision
from jaxcomp.kernels._autotune import ENV_CACHE
from jaxcomp.kernels._autotune import ENV_KERNELS
from jaxcomp.kernels._autotune import IMPLEMENTATIONS
from jaxcomp.kernels._autotune import TuneKey
from jaxcomp.kernels._autotune import autotune
from jaxcomp.kernels._autotune import default_autotuner
from jaxcomp.kernels._autotune import measure_seconds
from jaxcomp.kernels._autotune import resolve_implementation
from jaxcomp.kernels._autotune import use_autotuner
from jaxcomp.kernels._launch import Interpret
from jaxcomp.kernels._launch import nvidia_gpu

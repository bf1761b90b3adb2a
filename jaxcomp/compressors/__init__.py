"""Compressors: encode/decode pairs over flat float32 buffers, by name."""

from jaxcomp.compressors.base import Compressor
from jaxcomp.compressors.base import get
from jaxcomp.compressors.base import hyperparameters
from jaxcomp.compressors.base import names
from jaxcomp.compressors.base import register
from jaxcomp.compressors.identity import BF16
from jaxcomp.compressors.identity import Cast
from jaxcomp.compressors.identity import FP16
from jaxcomp.compressors.identity import Identity
from jaxcomp.compressors.qsgd import QSGD
from jaxcomp.compressors.random_block import RandomBlock
from jaxcomp.compressors.topk import TopK

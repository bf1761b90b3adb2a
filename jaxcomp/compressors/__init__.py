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
from jaxcomp.compressors.block_quant import FP8Block
from jaxcomp.compressors.block_quant import IntBlock
from jaxcomp.compressors.dgc import DGC
from jaxcomp.compressors.dgc import dgc_warmup_schedule
from jaxcomp.compressors.dgc import dgc_warmup_stages
from jaxcomp.compressors.dgc import dgc_warmup_steps
from jaxcomp.compressors.powersgd import PowerSGD
from jaxcomp.compressors.powersgd import PowerSGDState
from jaxcomp.compressors.random_k import RandomK
from jaxcomp.compressors.sign import MajorityVote
from jaxcomp.compressors.sign import OneBit
from jaxcomp.compressors.sign import ScaledSign
from jaxcomp.compressors.terngrad import TernGrad
from jaxcomp.compressors.threshold import Threshold

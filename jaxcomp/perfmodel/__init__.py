"""When does compression pay? Alpha-beta performance model of jaxcomp's exchanges.

See docs/perfmodel.md. References: Agarwal et al., *On the Utility of Gradient
Compression in Distributed Training Systems*, MLSys 2022; Zhang et al., *Is
Network the Bottleneck of Distributed Training?*, NetAI 2020; Shi et al.,
*MG-WFBP*, INFOCOM 2019.
"""

from jaxcomp.perfmodel.costs import COLLECTIVES
from jaxcomp.perfmodel.costs import Link
from jaxcomp.perfmodel.costs import Network
from jaxcomp.perfmodel.costs import allgather_time
from jaxcomp.perfmodel.costs import allreduce_time
from jaxcomp.perfmodel.costs import alltoall_time
from jaxcomp.perfmodel.costs import collective_time
from jaxcomp.perfmodel.costs import reduce_scatter_time
from jaxcomp.perfmodel.costs import ring_time
from jaxcomp.perfmodel.costs import transfer_time
from jaxcomp.bucketing import mgwfbp_plan
from jaxcomp.bucketing import wfbp_finish_time
from jaxcomp.perfmodel.goodput import goodput
from jaxcomp.perfmodel.goodput import island_seconds_lost
from jaxcomp.perfmodel.pricing import CodecCost
from jaxcomp.perfmodel.pricing import PricedCompressor
from jaxcomp.perfmodel.pricing import bucket_transfers
from jaxcomp.perfmodel.pricing import DeMoCompressor
from jaxcomp.perfmodel.pricing import DenseCompressor
from jaxcomp.perfmodel.pricing import IdealCompressor
from jaxcomp.perfmodel.optimizer_pricing import OPTIMIZERS
from jaxcomp.perfmodel.optimizer_pricing import CompressedOptimizer
from jaxcomp.perfmodel.optimizer_pricing import optimizer_phases
from jaxcomp.perfmodel.optimizer_pricing import optimizer_traffic
from jaxcomp.perfmodel.model_profile import ModelProfile
from jaxcomp.perfmodel.prediction import Prediction
from jaxcomp.perfmodel.timeline import bucket_plan
from jaxcomp.perfmodel.prediction import compare
from jaxcomp.perfmodel.pricing import default_collective
from jaxcomp.perfmodel.model_profile import load_profile_file
from jaxcomp.perfmodel.prediction import predict
from jaxcomp.perfmodel.model_profile import save_profile
from jaxcomp.perfmodel.profiles import BUILTIN_PROFILES
from jaxcomp.perfmodel.profiles import builtin_profile
from jaxcomp.perfmodel.profiles import load_profile
from jaxcomp.perfmodel.simulate import DEFAULT_WORKERS
from jaxcomp.perfmodel.simulate import required_ratio
from jaxcomp.perfmodel.simulate import stops_paying
from jaxcomp.perfmodel.simulate import sweep_bandwidth
from jaxcomp.perfmodel.simulate import sweep_workers


from jaxcomp.perfmodel.codec import measure_codec
from jaxcomp.perfmodel.profiling import profile
from jaxcomp.perfmodel.hardware import DEVICES
from jaxcomp.perfmodel.hardware import NETWORKS
from jaxcomp.perfmodel.hardware import DevicePreset
from jaxcomp.perfmodel.hardware import NetworkPreset
from jaxcomp.perfmodel.hardware import device_preset
from jaxcomp.perfmodel.hardware import network_preset
from jaxcomp.perfmodel.decoders import DECODERS
from jaxcomp.perfmodel.decoders import DecoderConfig
from jaxcomp.perfmodel.decoders import config_from_params
from jaxcomp.perfmodel.decoders import decoder_profile
from jaxcomp.perfmodel.kernel_table import gpu_codec
from jaxcomp.perfmodel.verdict import break_even

"""The public transform, :func:`compressed_mean`, and what it carries in its
state: its configuration (:func:`transform_configs`) and its traffic
statistics (:func:`get_stats`, which also reads the compressed optimizers'
per-phase counters, :class:`OneBitStats`).

Pieces, each on one screen: the factory and its ``init`` and ``update``,
functions of the resolved configuration (``_compressed_mean``), the bucket
bucket plan and its checks (``_buckets``), the bucket loop with its all-reduce and
reduce-scatter siblings (``_exchange``), the nonfinite policies
(``_nonfinite``), the statistics (``_stats``) and the configuration,
validated and resolved at construction and carried as static state
(``_config``).
"""

from jaxcomp.transform._compressed_mean import NONFINITE_POLICIES
from jaxcomp.transform._compressed_mean import OUTPUTS
from jaxcomp.transform._compressed_mean import CompressedMeanState
from jaxcomp.transform._compressed_mean import compressed_mean
from jaxcomp.transform._compressed_mean import in_micro_steps
from jaxcomp.transform._compressed_mean import over_axes
from jaxcomp.transform._compressed_mean import transform_configs
from jaxcomp.transform._compressed_mean import with_cadence
from jaxcomp.transform._config import TransformConfig
from jaxcomp.transform._stats import CompressionStats
from jaxcomp.transform._stats import ExchangeStats
from jaxcomp.transform._stats import OneBitStats
from jaxcomp.transform._stats import OneBitTraffic
from jaxcomp.transform._stats import dense_bytes_of
from jaxcomp.transform._stats import get_stats
from jaxcomp.transform._stats import traffic_stats
from jaxcomp._mesh import PerDeviceUnchecked

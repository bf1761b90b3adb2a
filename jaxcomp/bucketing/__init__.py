"""Which gradient leaves are compressed together.

A :class:`BucketPlan` splits the flattened gradient leaves (in
``jax.tree.leaves`` order) into an *exact* group, averaged with a plain
``pmean`` (leaves too small to be worth compressing: biases, norms; as
PyTorch PowerSGD's ``min_compression_rate`` and BytePS's minimum compression
size do), and *buckets*, each flattened into one float32 buffer and
compressed as a whole.

Strategies (``compressed_mean(bucketing=...)``):

* ``"auto"`` (the default): a leaf of at least ``bucket_bytes`` (default
  :data:`DEFAULT_BUCKET_BYTES`, 1 MB of float32: the size at which a ring
  all-reduce's start-up time equals its transfer time on the performance
  model's default network) is a bucket alone, so the layers that carry the
  bytes are compressed layer by layer; the smaller leaves (biases, norms,
  small matrices, whose own exchange would cost more in start-up than in
  bytes) are packed in leaf order, by dtype, into buckets of about that
  size, as PyTorch DDP's 25 MB buckets pack a whole model. Compressors that
  are bound to one tensor's shape (DCT top-k, chunked top-k) stay
  layer-wise, and so do plain psums of every leaf (identity, the casts over
  ``"psum"``), whose all-reduces XLA's combiner merges without a copy;
  PowerSGD compresses each tensor of a bucket on its own and exchanges the
  bucket's factors together (as PyTorch DDP's PowerSGD hook does per
  bucket);
* ``"layerwise"``: one bucket per leaf (layer-wise compression: top-k keeps
  the k largest of every layer);
* ``"whole"``: one bucket for the whole model (global top-k);
* ``"fixed"``: consecutive leaves until a bucket holds at least
  ``bucket_elements`` elements;
* ``"fixed_bytes"``: the same by size in bytes of the float32 buffer
  (``bucket_bytes``), as PyTorch DDP's ``bucket_cap_mb`` and Horovod's fusion
  buffer;
* ``"mgwfbp"`` or any explicit ``plan``: the MG-WFBP merge plan from
  :func:`mgwfbp_plan_for`, or lists of leaf indices of your own.
"""

from jaxcomp.bucketing._mgwfbp import mgwfbp_plan
from jaxcomp.bucketing._mgwfbp import wfbp_finish_time
from jaxcomp.bucketing._plans import BUFFER_ITEMSIZE
from jaxcomp.bucketing._plans import DEFAULT_BUCKET_BYTES
from jaxcomp.bucketing._plans import STRATEGIES
from jaxcomp.bucketing._plans import BucketPlan
from jaxcomp.bucketing._plans import check_config
from jaxcomp.bucketing._plans import fill
from jaxcomp.bucketing._plans import merge_small
from jaxcomp.bucketing._plans import mgwfbp_plan_for
from jaxcomp.bucketing._plans import plan_buckets

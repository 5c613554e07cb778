"""Codecs: what each compressed exchange encodes, sends and decodes.

>>> import jax, jax.numpy as jnp, jaxcomp as jc
>>> codec = jc.codecs.QSGD(levels=7, bucket_size=512, norm="max")
>>> x = jnp.linspace(-1.0, 1.0, 1024)
>>> payload = codec.encode(x, key=jax.random.key(0))
>>> codec.decode(payload).shape, codec.wire_bits(x.shape)
((1024,), 4160)
"""

from jaxcomp._src.codecs.base import QSGD
from jaxcomp._src.codecs.base import Cast
from jaxcomp._src.codecs.base import Codec
from jaxcomp._src.codecs.base import Identity
from jaxcomp._src.codecs.base import OneBit
from jaxcomp._src.codecs.base import Payload
from jaxcomp._src.codecs.base import ScaledSign
from jaxcomp._src.codecs.base import payload_nbytes
from jaxcomp._src.codecs.elias_codec import EliasQSGD
from jaxcomp._src.codecs.float8 import Float8
from jaxcomp._src.codecs.normal import NormalQuantizer
from jaxcomp._src.codecs.sparse import ChunkedTopK
from jaxcomp._src.codecs.sparse import RandomK
from jaxcomp._src.codecs.sparse import SparseCodec
from jaxcomp._src.codecs.sparse import TopK
from jaxcomp._src.codecs.wangni import UnbiasedSparsifier
from jaxcomp._src.exchanges.qweights import BlockInt8

__all__ = [
  "BlockInt8",
  "Cast",
  "ChunkedTopK",
  "Codec",
  "EliasQSGD",
  "Float8",
  "Identity",
  "NormalQuantizer",
  "OneBit",
  "Payload",
  "QSGD",
  "RandomK",
  "ScaledSign",
  "SparseCodec",
  "TopK",
  "UnbiasedSparsifier",
  "payload_nbytes",
]

"""Codecs: what each compressed exchange encodes, sends and decodes.

>>> import jax, jax.numpy as jnp, jaxcomp as jc
>>> codec = jc.codecs.QSGD(levels=7, bucket_size=512, norm="max")
>>> x = jnp.linspace(-1.0, 1.0, 1024)
>>> payload = codec.encode(x, key=jax.random.key(0))
>>> codec.decode(payload).shape, codec.wire_bits(x.shape)
((1024,), 4160)
"""

from jaxcomp._src.codecs import QSGD
from jaxcomp._src.codecs import Cast
from jaxcomp._src.codecs import Codec
from jaxcomp._src.codecs import Identity
from jaxcomp._src.codecs import OneBit
from jaxcomp._src.codecs import Payload
from jaxcomp._src.codecs import ScaledSign
from jaxcomp._src.codecs import payload_nbytes
from jaxcomp._src.elias_codec import EliasQSGD
from jaxcomp._src.normal import NormalQuantizer
from jaxcomp._src.qweights import BlockInt8
from jaxcomp._src.sparse import RandomK
from jaxcomp._src.sparse import SparseCodec
from jaxcomp._src.sparse import TopK
from jaxcomp._src.wangni import UnbiasedSparsifier

__all__ = [
  "BlockInt8",
  "Cast",
  "Codec",
  "EliasQSGD",
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

"""Elias recursive (omega) coding of QSGD payloads: the paper's string format, on the host.

The on-device encoder is :class:`jaxcomp.codecs.EliasQSGD`; this module is its NumPy
counterpart (serialize a QSGD payload to ``bytes`` and back, bit for bit) and the
format's reference. See :mod:`jaxcomp._src.codecs.elias` for the format.

>>> import jax, jaxcomp as jc
>>> codec = jc.codecs.QSGD(levels=64, norm="l2")  # s = sqrt(n), one bucket
>>> x = jax.random.normal(jax.random.key(0), (4096,))
>>> payload = codec.encode(x, key=jax.random.key(1))
>>> data = jc.elias.qsgd_to_bytes(codec, payload)
>>> back = jc.elias.qsgd_from_bytes(codec, data, x.shape)
>>> bool((codec.decode(back) == codec.decode(payload)).all())
True
>>> jc.elias.stream_bits(codec, payload), codec.wire_bits(x.shape)  # vs fixed width
(11325, 32800)
"""

from jaxcomp._src.codecs.elias import bytes_to_words
from jaxcomp._src.codecs.elias import decode_stream
from jaxcomp._src.codecs.elias import dense_bound
from jaxcomp._src.codecs.elias import encode_stream
from jaxcomp._src.codecs.elias import omega_decode
from jaxcomp._src.codecs.elias import omega_encode
from jaxcomp._src.codecs.elias import omega_length
from jaxcomp._src.codecs.elias import qsgd_from_bytes
from jaxcomp._src.codecs.elias import qsgd_to_bytes
from jaxcomp._src.codecs.elias import stream_bits
from jaxcomp._src.codecs.elias import theorem_3_2_bound
from jaxcomp._src.codecs.elias import words_to_bytes

__all__ = [
  "bytes_to_words",
  "decode_stream",
  "dense_bound",
  "encode_stream",
  "omega_decode",
  "omega_encode",
  "omega_length",
  "qsgd_from_bytes",
  "qsgd_to_bytes",
  "stream_bits",
  "theorem_3_2_bound",
  "words_to_bytes",
]

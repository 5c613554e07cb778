"""α-β cost model of gradient exchanges (see :mod:`jaxcomp._src.tools.network`).

>>> import jax, jax.numpy as jnp, jaxcomp as jc
>>> params = {"w": jnp.zeros((1024, 1024))}
>>> link = jc.network.Link(latency_s=50e-6, bandwidth=125e6)   # 1 Gbit/s
>>> for k in (2, 64):
...   dense = jc.wire_report(jc.compress(jc.codecs.Identity(), axis_name="b",
...                                      collective="two_phase"), params, axis_name="b",
...                          num_devices=k)
...   onebit = jc.wire_report(jc.onebit_sgd(axis_name="b"), params, axis_name="b",
...                           num_devices=k)
...   print(k, round(jc.network.exchange_time(dense, link), 4),
...         round(jc.network.exchange_time(onebit, link), 4))
2 0.0337 0.0014
64 0.0724 0.0211
"""

from jaxcomp._src.tools.network import Link
from jaxcomp._src.tools.network import compute_time
from jaxcomp._src.tools.network import exchange_time
from jaxcomp._src.tools.network import fit_link
from jaxcomp._src.tools.network import predict_step_time
from jaxcomp._src.tools.network import steps
from jaxcomp._src.tools.network import traffic

__all__ = [
  "Link",
  "compute_time",
  "exchange_time",
  "fit_link",
  "predict_step_time",
  "steps",
  "traffic",
]

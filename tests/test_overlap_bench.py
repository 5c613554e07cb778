"""benchmarks/overlap.py's split loop follows jc.diloco: what the benchmark times is the
library's semantics, overlapped and not."""

import jax
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from benchmarks import overlap
import jaxcomp as jc
from tests import helpers
from tests.helpers import AXIS
from tests.helpers import K
from tests.test_diloco import ShardMapRun

H, ROUNDS = 3, 4


@pytest.mark.parametrize(
  "mode,exchange",
  [("overlap", None), ("overlap", "onebit"), ("thread", None), ("blocking", "onebit")],
)
def test_split_loop_follows_diloco(mode, exchange):
  """The three programs (inner step, exchange, apply) dispatched as the benchmark does,
  on 8 devices over 4 syncs: the replicas and the anchor are jc.diloco's, with
  overlap=True for the overlapped loops (the exchange dispatched from the main
  thread or from a thread of its own) and without for the blocking one (to float32
  roundings: the split loop adds the inner update and the sync's move separately);
  and the two differ (the delay shows)."""
  params, loss = overlap.mlp(16, 1, 8)
  m = helpers.mesh()
  rng = np.random.default_rng(0)
  batches = [{k: rng.standard_normal((K, 4, 8)).astype(np.float32) for k in "xy"} for _ in range(5)]
  ex = lambda: (
    None if exchange is None else jc.onebit_sgd(axis_name=AXIS, filter=lambda path, x: x.ndim == 2)
  )
  inner, outer = optax.sgd(0.1, momentum=0.9), optax.sgd(0.7, momentum=0.9, nesterov=True)
  progs = overlap.programs(m, AXIS, params, loss, inner, outer, ex())
  put = lambda x: jax.device_put(x, jax.NamedSharding(m, P()))
  reps = helpers.shard(jax.tree.map(lambda x: np.broadcast_to(x, (K, *x.shape)), params), m)
  got_reps, got_anchor = overlap.run(
    progs,
    put(params),
    reps,
    [helpers.shard(b, m) for b in batches],
    ROUNDS,
    H,
    mode,
  )
  results = {}
  for o in (True, False):
    tx = jc.diloco(inner, outer, sync_every=H, axis_name=AXIS, exchange=ex(), overlap=o)
    grad_fn = lambda p, b: jax.grad(loss)(p, b)
    run = ShardMapRun(tx, params=params, grad_fn=grad_fn, mesh=m)
    results[o] = run.run(ROUNDS * H, lambda t: batches[(t - 1) % len(batches)])[-1]
  want_reps, want_state = results[mode != "blocking"]
  for got, want in ((got_reps, want_reps), (got_anchor, want_state.anchor)):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=2e-5)
  other = results[mode == "blocking"][1].anchor
  assert (
    max(np.abs(g - w).max() for g, w in zip(jax.tree.leaves(got_anchor), jax.tree.leaves(other)))
    > 1e-3
  )

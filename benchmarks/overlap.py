r"""Does DiLoCo's overlapped outer step hide the exchange? 2 processes, a throttled link.

The loop is split into jitted programs (:func:`programs`: an inner step, the exchange of
``Δ_i = B_i - θ_i``, the apply), timed per round as (a) non-overlapped DiLoCo, (b) the
exchange read one sync later, (b') the same dispatched from a thread of its own and (c)
the ``H`` inner steps alone. ``tests/test_overlap_bench.py`` checks the loop against
``jc.diloco(overlap=True)``. Results and what they mean: docs/benchmarks.md,
"Overlapped outer steps".
"""

from __future__ import annotations

import argparse
from concurrent import futures
import functools
import json
import statistics
import sys
import time
from typing import Any
from typing import NamedTuple

import jax
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from benchmarks import network
from benchmarks._timing import md_head
from benchmarks._timing import md_row
import jaxcomp as jc


class Programs(NamedTuple):
  """The split loop's jitted programs, under ``shard_map`` over one axis of replicas."""

  init: Any  # params -> (inner_state, outer_state, exchange_state)
  inner: Any  # (reps, inner_state, batch) -> (reps, inner_state)
  exchange: Any  # (reps, start, anchor, exchange_state) -> (mean, exchange_state)
  apply: Any  # (reps, start, anchor, mean, outer_state) -> (reps, start, anchor, outer_state)
  reset: Any  # as apply, but θ_i ← A: non-overlapped DiLoCo


def programs(mesh, axis, params, loss, inner, outer, exchange=None) -> Programs:
  """The programs for replicas held ``(K, *shape)`` over ``axis``; ``exchange`` a
  jaxcomp exchange over ``axis`` (``None``: dense mean, :func:`jaxcomp.pmean_tree`)."""
  inner = jc.per_device_state(inner)
  ex = None if exchange is None else jc.per_device_state(exchange)
  spec = lambda tx: jc.state_specs(tx, params, axis_name=axis, num_devices=mesh.size)
  ex_spec = P() if ex is None else spec(ex)
  row = lambda t: jax.tree.map(lambda x: x[0], t)
  put = lambda t: jax.tree.map(lambda x: x[None], t)
  smap = lambda f, i, o: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o))
  a = P(axis)

  def init(p):
    return inner.init(p), outer.init(p), None if ex is None else ex.init(p)

  def inner_step(reps, state, batch):
    p = row(reps)
    u, state = inner.update(jax.grad(loss)(p, row(batch)), state, p)
    return put(optax.apply_updates(p, u)), state

  def exchange_step(reps, start, anchor, state):
    delta = jax.tree.map(lambda b, p: b - p, row(start), row(reps))
    if ex is None:
      return jc.pmean_tree(delta, axis), state
    return ex.update(delta, state, anchor)

  def apply_step(reps, start, anchor, mean, state, *, keep=True):
    u, state = outer.update(mean, state, anchor)
    anchor = optax.apply_updates(anchor, u)
    p = row(reps)
    if keep:  # the replica keeps its in-flight progress on top of the new anchor
      p = jax.tree.map(lambda p_, a_, b_: p_ + (a_ - b_), p, anchor, row(start))
    else:  # non-overlapped DiLoCo: every replica restarts from the anchor
      p = jc.vary(anchor, axis)
    return put(p), put(p), anchor, state

  o_spec = spec(outer)
  apply_specs = ((a, a, P(), P(), o_spec), (a, a, P(), o_spec))
  return Programs(
    init=smap(init, P(), (spec(inner), o_spec, ex_spec)),
    inner=smap(inner_step, (a, spec(inner), a), (a, spec(inner))),
    exchange=smap(exchange_step, (a, a, P(), ex_spec), (P(), ex_spec)),
    apply=smap(apply_step, *apply_specs),
    reset=smap(lambda *x: apply_step(*x, keep=False), *apply_specs),
  )


def run(progs: Programs, params, reps, batches, rounds: int, h: int, mode: str, clock=None):
  """``rounds`` rounds of ``h`` inner steps, each ending with a sync (``mode``:
  ``"overlap"``; ``"thread"``, the same with the exchange dispatched from a thread of its
  own; ``"blocking"``; ``"inner"``); returns the final (reps, anchor). ``clock``: a list
  that gets the time at the end of each round, its replicas ready (which in the
  overlapped modes waits for the exchange of the round before, not this one's)."""
  inner_state, outer_state, ex_state = progs.init(params)
  start, anchor, pending, fut = reps, params, None, None
  pool = futures.ThreadPoolExecutor(1) if mode == "thread" else None
  for s in range(rounds):
    for t in range(h):
      reps, inner_state = progs.inner(reps, inner_state, batches[(s * h + t) % len(batches)])
    if mode != "inner":
      if fut is not None:  # the previous sync's exchange, dispatched from the thread
        pending, ex_state = fut.result()
      if pool is None:
        mean, ex_state = progs.exchange(reps, start, anchor, ex_state)
      else:
        fut = pool.submit(progs.exchange, reps, start, anchor, ex_state)
      if mode == "blocking":
        reps, start, anchor, outer_state = progs.reset(reps, start, anchor, mean, outer_state)
      elif pending is None:  # the first sync: nothing pending, the anchor stays
        start = reps
      else:
        reps, start, anchor, outer_state = progs.apply(reps, start, anchor, pending, outer_state)
      pending = pending if pool else mean
    if clock is not None:
      jax.block_until_ready(reps)
      clock.append(time.perf_counter())
  jax.block_until_ready((pending, fut and fut.result()))  # before other collectives
  return reps, anchor


def mlp(width: int, depth: int, d_in: int, seed: int = 0):
  """An MLP's parameters (numpy) and its squared-error loss."""
  rng, dims = np.random.default_rng(seed), [d_in] + [width] * depth + [d_in]
  params = {
    f"l{i}": {
      "w": (rng.standard_normal((m, n)) / np.sqrt(m)).astype(np.float32),
      "b": np.zeros(n, np.float32),
    }
    for i, (m, n) in enumerate(zip(dims[:-1], dims[1:]))
  }

  def loss(p, batch):
    x = batch["x"]
    for i in range(len(p)):
      x = x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
      x = jax.numpy.tanh(x) if i < len(p) - 1 else x
    return jax.numpy.mean((x - batch["y"]) ** 2)

  return params, loss


def worker(args) -> None:
  """One process of the 2: every mode timed over ``args.rounds`` rounds after one."""
  network.join(args)
  mesh = jax.make_mesh((2,), ("b",))
  width, depth, d_in, batch = map(int, args.model.split(","))
  params, loss = mlp(width, depth, d_in)
  rep = jax.NamedSharding(mesh, P())
  params = jax.tree.map(
    lambda x: jax.make_array_from_callback(x.shape, rep, lambda i: x[i]), params
  )
  local = lambda x: jax.make_array_from_process_local_data(jax.NamedSharding(mesh, P("b")), x)
  rng = np.random.default_rng(1 + args.process_id)
  batches = [
    {k: local(rng.standard_normal((1, batch, d_in)).astype(np.float32)) for k in "xy"}
    for _ in range(4)
  ]
  exchange = None if args.exchange == "dense" else jc.qsgd(bits=4, axis_name="b")
  tx_in, tx_out = optax.sgd(0.01, momentum=0.9), optax.sgd(0.7, momentum=0.9, nesterov=True)
  progs = programs(mesh, "b", params, loss, tx_in, tx_out, exchange)
  reps = jax.tree.map(lambda x: local(np.asarray(x.addressable_data(0))[None]), params)
  out: dict[str, Any] = {"params": sum(x.size for x in jax.tree.leaves(params))}
  _, _, ex_state = progs.init(params)
  jax.block_until_ready(progs.exchange(reps, reps, params, ex_state))  # compile
  t0 = time.perf_counter()
  mean, _ = progs.exchange(reps, reps, params, ex_state)
  out["exchange_dispatch_s"] = time.perf_counter() - t0  # the call's return: inline?
  jax.block_until_ready(mean)
  out["exchange_s"] = time.perf_counter() - t0
  for mode in args.modes.split(","):  # the median round past the first (the pipeline fills)
    jax.block_until_ready(run(progs, params, reps, batches, 2, args.h, mode))  # compile, warm
    clock = [time.perf_counter()]
    jax.block_until_ready(run(progs, params, reps, batches, args.rounds + 1, args.h, mode, clock))
    out[mode] = statistics.median(np.diff(clock[1:]).tolist())
    out[mode + "_rounds"] = np.diff(clock).tolist()
  network.emit(out)


def launch_pair(args, prefix=None, host: str = network.ADDRESSES[0]) -> dict:
  """The two workers (``prefix(i)`` before each); process 0's result."""
  flags = ["--worker"] + [f"--{k}={getattr(args, k)}" for k in ("model", "h", "rounds")]
  flags += [f"--exchange={args.exchange}", f"--modes={args.modes}"]
  return network.run_on_link(
    "benchmarks.overlap", flags, prefix=prefix, host=host, timeout=args.timeout
  )


def row(rate: str, r: dict, h: int) -> str:
  """A results row: times per round (s), and the part of the exchange each overlap hid."""
  hideable = min(r["exchange_s"], r["inner"])
  hid = lambda m: f"{(r['blocking'] - r[m]) / hideable:+.0%}"
  ex = f"{r['exchange_s'] * 1e3:.0f} ({r['exchange_dispatch_s'] * 1e3:.0f})"
  times = [f"{r[m]:.3f}" for m in ("blocking", "overlap", "thread", "inner")]
  return md_row(rate, f"{r['inner'] / h * 1e3:.1f}", ex, *times, hid("overlap"), hid("thread"))


def price() -> str:
  """Time saved per sync, min(exchange, H x inner step), the exchange priced by jc.network
  (α = 50 µs); the share is of the non-overlapped round, H x inner step + exchange."""
  lm = {f"l{i}": jax.ShapeDtypeStruct((2048, 24576), np.float32) for i in range(24)}
  lm_step = 6 * 1.2e9 * 65536 / 0.4 / 989e12
  models = {  # name: (params, inner step (s), K, H, rates in Mbit/s)
    "MLP 2.1M, 1 core (measured step)": (mlp(1024, 2, 512)[0], 0.12, 2, 8, (10, 100, 1000)),
    "LM 1.2B, H100 at 40%, 64k tok/step": (lm, lm_step, 8, 50, (1e3, 1e4, 1e5)),
  }
  head = "model | exchange | K | H | link | exchange/sync (s) | H inner steps (s) | saved/sync (s)"
  lines = [md_head(head + " | share of round", "llrrlrrrr")]
  for name, (params, step_s, k, h, rates) in models.items():
    for ex_name, ex in (("dense", None), ("qsgd4", lambda: jc.qsgd(bits=4, axis_name="b"))):
      tx = jc.diloco(
        optax.sgd(0.1), optax.sgd(1.0), sync_every=h, axis_name="b", exchange=ex and ex()
      )
      report = jc.wire_report(tx, params, axis_name="b", num_devices=k)
      for mbit in rates:
        t_ex = h * jc.network.exchange_time(report, jc.network.Link(50e-6, mbit * 1e6 / 8))
        saved = min(t_ex, h * step_s)
        link = f"{mbit / 1e3:g} Gbit/s" if mbit >= 1e3 else f"{mbit:g} Mbit/s"
        cells = [name, ex_name, k, h, link, f"{t_ex:.3g}", f"{h * step_s:.3g}", f"{saved:.3g}"]
        lines.append(md_row(*cells, f"{saved / (h * step_s + t_ex):.0%}"))
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  network.add_worker_flags(p)
  p.add_argument("--smoke", action="store_true", help="127.0.0.1, tiny model, no root")
  p.add_argument("--price", action="store_true", help="only jc.network's pricing table")
  p.add_argument("--rates", default="100mbit,10mbit")
  p.add_argument("--exchange", default="dense", choices=("dense", "qsgd4"))
  p.add_argument("--modes", default="inner,blocking,overlap,thread")
  p.add_argument("--model", default="1024,2,512,256", help="MLP width,depth,d_in,batch")
  p.add_argument("--h", type=int, default=8, help="inner steps per sync")
  p.add_argument("--rounds", type=int, default=4)
  p.add_argument("--timeout", type=float, default=900)
  p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True, help="a core each")
  args = p.parse_args(argv)
  if args.worker:
    worker(args)
    return 0
  if args.price:
    return print(price()) or 0
  head = "rate | inner step (ms) | exchange (returned after) (ms) | (a) blocking | (b) overlap"
  print(md_head(head + " | (b') thread | (c) inner | hidden (b) | hidden (b')"), flush=True)
  if args.smoke:
    args.model, args.rounds, args.h = "64,2,32,16", 2, 2
    r = launch_pair(args, host="127.0.0.1")
    print(row("127.0.0.1", r, args.h) + "\n" + json.dumps(r))
    return 0

  if network.cannot_run("benchmarks.overlap"):
    return 2
  with network.open_link() as link:
    for rate in args.rates.split(","):
      link.set_rate(rate)
      r = launch_pair(args, functools.partial(link.worker_prefix, pin=args.pin))
      print(row(rate, r, args.h) + "\n" + json.dumps(r), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())

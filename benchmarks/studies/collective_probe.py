"""Times psum, all_gather and all_to_all of the same per-process bytes across 2 processes.

  python -m benchmarks.studies.collective_probe            # 2 processes on 127.0.0.1 (gloo)
  python -m benchmarks.studies.collective_probe --hlo      # what XLA combines (one process)
  sudo python -m benchmarks.studies.collective_probe --rate 100mbit   # across the throttled link

``--rate R`` runs the two processes in :mod:`benchmarks.network`'s namespaces, the link
throttled to ``R`` (tbf, the same bucket as that benchmark), so the bytes each
collective really moves show in its time: at 100 Mbit/s a megabyte takes 80 ms.

``--hlo`` compiles six independent per-leaf collectives of each kind on 4 CPU devices
and prints how many remain in the optimized HLO: XLA combines independent all-reduces
into one, and (XLA:CPU, jax 0.10) not all-gathers or all-to-alls, which is why
``jaxcomp`` fuses its payloads itself (``collectives.gather_tree``).

Each process contributes ``B`` bytes. Ideal per-process traffic at K = 2: a ring psum
sends ``B`` (half in its reduce-scatter, half in its all-gather), an all_gather sends
``B``, an all_to_all ``B/2``, a ppermute (each sends its buffer to the other) ``B``.
Prints the median time of each, so one can see how the
CPU collectives (gloo) implement them: if the all_gather took as long as a psum of
twice the bytes, it would be moving twice what it needs. The last column sums the same
bytes as 16 separate leaves (``lax.psum`` per leaf, which XLA combines into one
all-reduce instruction of 16 operands): on XLA:CPU it costs one gloo round per operand,
which is why ``jaxcomp`` averages the dense leaves as one buffer
(``collectives.psum_tree``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchmarks import network
from benchmarks.network import RESULT_MARKER
from benchmarks.network import free_port

SIZES = (1 << 16, 1 << 20, 1 << 22, 1 << 24)
LEAVES = 16


def worker(args) -> None:
  from benchmarks import launch  # pylint: disable=import-outside-toplevel

  launch.init_distributed(args.coordinator, 2, args.process_id, devices_per_process=1)
  import jax  # pylint: disable=import-outside-toplevel
  from jax import lax  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  mesh = jax.make_mesh((2,), ("b",))
  ops = {
    "psum": lambda x: lax.psum(x, "b"),
    "psum_2x": lambda x: lax.psum(jax.numpy.concatenate([x, x]), "b"),
    "all_gather": lambda x: lax.all_gather(x, "b", tiled=True),
    "all_to_all": lambda x: lax.all_to_all(x.reshape(2, -1), "b", 0, 0).reshape(-1),
    # Each process sends its B bytes to the other: what an all-gather of 2 must move.
    "ppermute": lambda x: lax.ppermute(x, "b", perm=[(0, 1), (1, 0)]),
    # The same bytes as 16 leaves: XLA combines the 16 psums into one all-reduce
    # instruction of 16 operands; gloo then runs one all-reduce per operand.
    "psum_16_leaves": lambda x: jax.numpy.concatenate(
      [lax.psum(p, "b") for p in jax.numpy.split(x, LEAVES)]
    ),
  }
  rows = []
  for size in args.sizes:
    local = np.ones((size // 4,), np.float32)
    x = jax.make_array_from_process_local_data(jax.NamedSharding(mesh, P("b")), local)
    row = {"bytes": size}
    for name, op in ops.items():
      f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P("b"), out_specs=P("b")))
      f(x).block_until_ready()
      times = []
      for _ in range(args.repeats):
        start = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - start)
      row[name] = statistics.median(times)
    rows.append(row)
  print(RESULT_MARKER + json.dumps(rows), flush=True)
  jax.distributed.shutdown()


def combined_counts(leaves: int = 6) -> dict[str, int]:
  """Collectives left in the compiled HLO of ``leaves`` independent per-leaf ones."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax import lax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  k = min(4, jax.local_device_count())
  tree = [jnp.ones((k, k, 64 + i)) for i in range(leaves)]
  ops = {
    "all-reduce": lambda x: lax.psum(x, "b"),
    "all-gather": lambda x: lax.all_gather(x, "b"),
    "all-to-all": lambda x: lax.all_to_all(x, "b", 0, 0),
  }
  counts = {}
  for name, op in ops.items():
    f = jax.pmap(
      lambda t, op=op: [op(x) for x in t], axis_name="b", devices=jax.local_devices()[:k]
    )
    hlo = f.lower(tree).compile().as_text()
    counts[name] = hlo.count(f"{name}(") + hlo.count(f"{name}-start(")
  return counts


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument(
    "--sizes",
    default=",".join(map(str, SIZES)),
    help=f"bytes per process, comma-separated (multiples of {4 * LEAVES})",
  )
  parser.add_argument(
    "--hlo", action="store_true", help="count what XLA combines of 6 per-leaf collectives, and exit"
  )
  parser.add_argument(
    "--rate",
    default=None,
    help="run across benchmarks.network's namespaces throttled to this "
    "rate (e.g. 100mbit; needs root)",
  )
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  args.sizes = [int(v) for v in args.sizes.split(",")]
  if any(v <= 0 or v % (4 * LEAVES) for v in args.sizes):
    parser.error(f"--sizes must be positive multiples of {4 * LEAVES}, got {args.sizes}")
  if args.worker:
    worker(args)
    return 0
  if args.hlo:
    import jax  # pylint: disable=import-outside-toplevel

    try:  # 4 CPU devices, unless JAX's backends already run (then they keep theirs)
      jax.config.update("jax_num_cpu_devices", 4)
    except RuntimeError:
      pass
    print("| collective | per-leaf ops | left after XLA's passes |")
    print("|---|---:|---:|")
    for name, n in combined_counts().items():
      print(f"| {name} | 6 | {n} |")
    return 0
  from benchmarks import launch  # pylint: disable=import-outside-toplevel

  def commands(host: str, prefix=lambda i: []) -> list[list[str]]:
    coordinator = f"{host}:{free_port()}"
    return [
      [
        *prefix(i),
        sys.executable,
        "-m",
        "benchmarks.studies.collective_probe",
        "--worker",
        "--process-id",
        str(i),
        "--coordinator",
        coordinator,
        "--repeats",
        str(args.repeats),
        "--sizes",
        ",".join(map(str, args.sizes)),
      ]
      for i in range(2)
    ]

  if args.rate is None:
    outputs = launch.run_processes(commands("127.0.0.1"), timeout=600)
  else:
    network.rate_bytes_per_s(args.rate)  # validate before building anything
    if network.cannot_run("benchmarks/studies/collective_probe.py --rate"):
      return 2
    with network.Link() as link:
      bucket = link.set_rate(args.rate)
      print(f"link {args.rate}, tbf bucket {bucket:,} B" if bucket else "link unthrottled")
      outputs = launch.run_processes(
        commands(network.ADDRESSES[0], network.Link.prefix), timeout=600
      )
  for line in outputs[0].stdout:
    if line.startswith(RESULT_MARKER):
      rows = json.loads(line[len(RESULT_MARKER) :])
      break
  else:
    raise RuntimeError("no result:\n" + outputs[0].tail())
  print(
    "| bytes per process | psum (ms) | psum of 2x (ms) | all_gather (ms) |"
    f" all_to_all (ms) | ppermute (ms) | psum as {LEAVES} leaves (ms) |"
  )
  print("|---:|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    print(
      f"| {r['bytes']:,} | {1e3 * r['psum']:.2f} | {1e3 * r['psum_2x']:.2f} |"
      f" {1e3 * r['all_gather']:.2f} | {1e3 * r['all_to_all']:.2f} |"
      f" {1e3 * r['ppermute']:.2f} | {1e3 * r['psum_16_leaves']:.2f} |"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())

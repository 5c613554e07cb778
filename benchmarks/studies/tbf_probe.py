"""Raw TCP across the throttled link: what ``tc tbf``'s bucket does to one message.

Builds :mod:`benchmarks.network`'s two namespaces and veth pair, throttles them with
``tbf rate R burst B``, and has one process in each namespace send the other ``n`` bytes
over one TCP connection at the same time (both directions at once, as a 2-process
all-gather does), after a handshake. It prints the milliseconds until a process has
received its ``n`` bytes, and that as MB/s, for every rate, bucket and size, with the
qdisc's drop counters.

  sudo python -m benchmarks.studies.tbf_probe                       # 1 Gbit/s and 100 Mbit/s
  sudo python -m benchmarks.studies.tbf_probe --rates 1gbit --burst-ms 10,1 --sizes 1048576

A message that fits in the bucket's credit leaves at the sender's speed, not the
rate: with 10 ms of traffic in the bucket (1.25 MB at 1 Gbit/s) a 1 MB payload crossed
in about 2 ms. ``benchmarks.network`` therefore uses 1 ms of traffic, at least 64 KiB.
Needs root, like ``benchmarks.network``; everything it creates is removed at the end.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time

from benchmarks import network

PORT = 40123


def peer(role: str, me: str, other: str, nbytes: int) -> None:
  """One side: connect, handshake, then send ``nbytes`` while receiving as many."""
  if role == "listen":
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((me, PORT))
    srv.listen(1)
    conn, _ = srv.accept()
  else:
    for _ in range(200):
      try:
        conn = socket.create_connection((other, PORT))
        break
      except OSError:
        time.sleep(0.05)
    else:
      raise SystemExit(f"could not connect to {other}:{PORT}")
  conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  conn.sendall(b"r")
  conn.recv(1)
  start = time.perf_counter()
  sender = threading.Thread(target=conn.sendall, args=(b"x" * nbytes,))
  sender.start()
  got = 0
  while got < nbytes:
    chunk = conn.recv(1 << 20)
    if not chunk:
      raise SystemExit(f"connection closed after {got} of {nbytes} bytes")
    got += len(chunk)
  sender.join()
  print(f"{1e3 * (time.perf_counter() - start):.2f}")


def exchange_ms(nbytes: int) -> list[float]:
  """Milliseconds for each side to receive ``nbytes`` (both sending at once)."""
  cmds = [
    [
      "ip",
      "netns",
      "exec",
      ns,
      sys.executable,
      "-m",
      "benchmarks.studies.tbf_probe",
      "--peer",
      role,
      network.ADDRESSES[i],
      network.ADDRESSES[1 - i],
      str(nbytes),
    ]
    for i, (ns, role) in enumerate(zip(network.NAMESPACES, ("listen", "connect")))
  ]
  listener = subprocess.Popen(cmds[0], stdout=subprocess.PIPE, text=True)
  time.sleep(0.3)
  connector = subprocess.Popen(cmds[1], stdout=subprocess.PIPE, text=True)
  outs = [p.communicate(timeout=120)[0] for p in (listener, connector)]
  return [float(o.split()[-1]) for o in outs]


def drops(link: network.Link) -> int:
  """Packets both qdiscs dropped so far."""
  total = 0
  for ns, veth in zip(network.NAMESPACES, network.VETHS):
    text = link.exec(ns, ["tc", "-s", "qdisc", "show", "dev", veth]).stdout
    for word, nxt in zip(text.split(), text.split()[1:]):
      if word == "(dropped":
        total += int(nxt.rstrip(","))
  return total


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rates", default="1gbit,100mbit")
  parser.add_argument("--burst-ms", default="10,1", help="tbf buckets, ms of traffic")
  parser.add_argument("--sizes", default="262144,1048576,10485760", help="bytes each way")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument(
    "--peer", nargs=4, metavar=("ROLE", "ME", "OTHER", "NBYTES"), help=argparse.SUPPRESS
  )
  args = parser.parse_args(argv)
  if args.peer:
    role, me, other, nbytes = args.peer
    peer(role, me, other, int(nbytes))
    return 0
  if network.cannot_run("benchmarks/studies/tbf_probe.py"):
    return 2
  print(
    "| rate | bucket (bytes) | bytes each way | ms (each run, both sides) | MB/s (median) "
    "| line rate (MB/s) | drops |"
  )
  print("|---|---:|---:|---|---:|---:|---:|")
  with network.Link() as link:
    for rate in args.rates.split(","):
      for burst_ms in (float(b) for b in args.burst_ms.split(",")):
        bucket = link.set_rate(rate, burst_ms)
        for nbytes in (int(s) for s in args.sizes.split(",")):
          before = drops(link)
          times = [t for _ in range(args.repeats) for t in exchange_ms(nbytes)]
          median = sorted(times)[len(times) // 2]
          print(
            f"| {rate} | {bucket:,} | {nbytes:,} | {', '.join(f'{t:.0f}' for t in times)} "
            f"| {nbytes / median / 1e3:.1f} | {network.rate_bytes_per_s(rate) / 1e6:.1f} "
            f"| {drops(link) - before} |",
            flush=True,
          )
  return 0


if __name__ == "__main__":
  sys.exit(main())

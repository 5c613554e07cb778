r"""What QSGD's native CPU encode spends its time on: the bucket loop, with parts removed.

Builds a C++ harness around ``kernels/cpu_codecs.cc`` (the kernels' flags) as shipped and
without the counter hash (``-DJAXCOMP_ABLATE_HASH``: wrong payloads, it prices the hash),
and times ``QsgdBucket`` over n values on one thread: from one L1-resident bucket, or
(``--stream``) a fresh array, then also without the next bucket's prefetch. ``--against
FILE`` adds a build of another ``cpu_codecs.cc``; the builds take turns ``--rounds``
times, each row the median of all its timings. Results: docs/guides/kernels.md.

  python -m benchmarks.studies.cpu_kernel_loop                 # 4-bit codes, bucket 512, 2^24
  python -m benchmarks.studies.cpu_kernel_loop --stream
  python -m benchmarks.studies.cpu_kernel_loop --bits 8 --log2n 22 --repeats 7
"""

from __future__ import annotations

import argparse
from pathlib import Path
import statistics
import subprocess
import sys
import tempfile

import jax

from benchmarks._timing import md_head
from jaxcomp.kernels import cpu

HARNESS = r"""
#include "cpu_codecs.cc"
#include <chrono>
#include <cstdio>
#include <cstdlib>
int main(int argc, char** argv) {
  const int64_t n = int64_t{1} << std::atoi(argv[1]);
  const int64_t bucket = std::atoi(argv[2]);
  const int repeats = std::atoi(argv[3]);
  const bool stream = std::atoi(argv[4]) != 0, prefetch = std::atoi(argv[5]) != 0;
  const int64_t nb = n / bucket;
  std::vector<float> v(stream ? n : bucket);
  for (int64_t i = 0; i < static_cast<int64_t>(v.size()); ++i) v[i] = std::sin(0.37f * i) * 3.0f;
  std::vector<uint32_t> codes(bucket), words(n * HARNESS_BITS / 32);
  std::vector<float> scales(nb);
  const QsgdParams p{n, bucket, (1 << (HARNESS_BITS - 1)) - 1, false, 123u, 456u};
  uint64_t check = 0;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t b = 0; b < nb; ++b) {
      const float* x = stream ? v.data() + b * bucket : v.data();
      // What QsgdEncode passes: the next whole bucket, if any.
      const float* ahead = stream && prefetch && (b + 2) * bucket <= n ? x + bucket : nullptr;
      QsgdBucket<HARNESS_BITS>(p, b, x, bucket, words.data(), scales.data(), nullptr,
                               codes.data(), ahead, nullptr);
    }
    const auto t1 = std::chrono::steady_clock::now();
    for (uint32_t w : words) check += w;  // the results are used
    std::printf("%.4f\n", std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::fprintf(stderr, "%llu\n", static_cast<unsigned long long>(check));
}
"""

VARIANTS = {"as shipped": [], "without the hash": ["-DJAXCOMP_ABLATE_HASH"]}


def build(tmp: Path, bits: int, defines: list[str], name: str, source: Path = cpu.SOURCE) -> Path:
  src = tmp / f"{name}_src"
  src.mkdir()
  (src / "cpu_codecs.cc").write_text(Path(source).read_text())
  main = src / "harness.cc"
  main.write_text(HARNESS)
  exe = tmp / name
  flags = [f for f in cpu.FLAGS if f not in ("-shared", "-fPIC")]
  cmd = [*cpu._compiler(), *flags, f"-DHARNESS_BITS={bits}", *defines, "-I", str(src)]
  cmd += ["-I", jax.ffi.include_dir(), str(main), "-o", str(exe)]
  done = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if done.returncode != 0:
    sys.exit(f"build failed: {' '.join(cmd)}\n{done.stderr[-3000:]}")
  return exe


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--bits", type=int, default=4, choices=(2, 4, 8, 16))
  parser.add_argument("--bucket", type=int, default=512)
  parser.add_argument("--log2n", type=int, default=24)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--stream", action="store_true", help="read a fresh n-value array")
  parser.add_argument("--against", type=Path, metavar="FILE", help="also time this cpu_codecs.cc")
  parser.add_argument("--rounds", type=int, default=1, help="turns the builds take")
  args = parser.parse_args(argv)
  if args.against is not None and not args.against.is_file():
    sys.exit(f"--against: no such file: {args.against}")
  n = 2**args.log2n
  with tempfile.TemporaryDirectory() as tmp:
    exes = {
      name: build(Path(tmp), args.bits, d, f"v{i}") for i, (name, d) in enumerate(VARIANTS.items())
    }
    runs = [(name, exe, True) for name, exe in exes.items()]
    if args.against is not None:
      baseline = build(Path(tmp), args.bits, [], "baseline", args.against)
      runs.insert(1, (f"baseline: {args.against.name}", baseline, True))
    if args.stream:
      runs.append(("without the prefetch", exes["as shipped"], False))
    samples = {name: [] for name, _, _ in runs}
    for _ in range(args.rounds):
      for name, exe, prefetch in runs:
        cmd = [exe, args.log2n, args.bucket, args.repeats, int(args.stream), int(prefetch)]
        out = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, check=True)
        samples[name] += [float(t) for t in out.stdout.split()]
    times = {name: statistics.median(ts) for name, ts in samples.items()}
  source = "a fresh array" if args.stream else "one L1-resident bucket"
  print(
    f"QsgdBucket<{args.bits}>, bucket {args.bucket}, n = 2^{args.log2n} from {source}, "
    f"one thread, median of {args.rounds} x {args.repeats}"
  )
  print(md_head("build | ms | ns/value | vs shipped"))
  for name, ms in times.items():
    print(f"| {name} | {ms:.2f} | {1e6 * ms / n:.3f} | {ms / times['as shipped']:.2f} |")


if __name__ == "__main__":
  main()

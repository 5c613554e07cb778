"""Smoke tests of benchmark-script options that change how the process runs."""

import os
from pathlib import Path
import platform
import re
import subprocess
import sys

import pytest

from benchmarks import _timing

ROOT = Path(__file__).resolve().parents[1]
glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="needs glibc")


def _codecs(*flags: str) -> str:
  env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run(
    [
      sys.executable,
      "-m",
      "benchmarks.codecs",
      "--sizes",
      "10",
      "--codecs",
      "qsgd4",
      "--repeats",
      "1",
      *flags,
    ],
    cwd=ROOT,
    env=env,
    check=True,
    capture_output=True,
    text=True,
    timeout=300,
  ).stdout


@glibc_only
def test_reuse_malloc_restarts_the_benchmark_with_the_tunables():
  default = _codecs("--rng")
  assert "malloc: glibc default" in default
  assert "| 2^10 | qsgd4 |" in default and "random bits to uint8: jaxcomp hash" in default
  reused = _codecs("--reuse-malloc")
  assert "malloc: glibc reuse" in reused, reused
  assert "| 2^10 | qsgd4 |" in reused
  # the restart happens once: one header line, one table
  assert reused.count("malloc:") == 1


def test_rounds_print_the_median_share_of_the_roof_and_its_range():
  from benchmarks import codecs  # pylint: disable=import-outside-toplevel

  assert codecs.share_cell([0.254]) == "25"
  assert codecs.share_cell([0.30, 0.21, 0.26]) == "26 (21–30)"
  out = _codecs("--rounds", "3")
  assert "% read roof: median (range) of 3 rounds" in out, out
  row = next(line for line in out.splitlines() if line.startswith("| 2^10 | qsgd4 |"))
  assert re.fullmatch(r"\d+ \(\d+–\d+\)", row.split("|")[7].strip()), row  # 3 shares
  bad = subprocess.run(
    [sys.executable, "-m", "benchmarks.codecs", "--rounds", "0"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert bad.returncode == 2 and "--rounds must be at least 1" in bad.stderr


def test_native_vs_xla_counts_divisions_over_bucket_values_only():
  from benchmarks.studies import native_vs_xla  # pylint: disable=import-outside-toplevel

  hlo = "\n".join(
    [
      'a = f32[64,512]{1,0} divide(x, y), metadata={op_name="jit(s)/jaxcomp_encode/div"}',
      'b = f32[8,4,512]{2,1,0} divide(x, y), metadata={op_name="s/jaxcomp_encode/div"}',
      'c = f32[8,4]{1,0} divide(x, y), metadata={op_name="s/jaxcomp_encode/div"}',  # 1/scale
      'd = f32[64,512]{1,0} multiply(x, y), metadata={op_name="s/jaxcomp_encode/mul"}',
      'e = f32[64,512]{1,0} divide(x, y), metadata={op_name="s/loss/div"}',
    ]
  )
  assert native_vs_xla.encode_divisions(hlo, 512) == 2
  assert native_vs_xla.encode_divisions(hlo, 128) == 0


@glibc_only
def test_malloc_label_names_the_tunables(monkeypatch):
  monkeypatch.setenv("GLIBC_TUNABLES", _timing.REUSE_MALLOC)
  assert _timing.malloc_label() == "glibc reuse"
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
  assert _timing.malloc_label() == "glibc glibc.malloc.arena_max=2"
  monkeypatch.delenv("GLIBC_TUNABLES")
  assert _timing.malloc_label() == "glibc default"


def test_tbf_bucket_is_a_millisecond_of_traffic_at_least_64_kib():
  from benchmarks import network  # pylint: disable=import-outside-toplevel

  # 1 ms at the rate: at 1 Gbit/s a 1 MB payload no longer fits in the bucket's credit
  assert network.tbf_burst("1gbit") == 125_000
  assert network.tbf_burst("10gbit") == 1_250_000
  assert network.tbf_burst("100mbit") == 64 * 1024  # the floor
  assert network.tbf_burst("1gbit", burst_ms=10) == 1_250_000  # the first setting
  assert network.tbf_burst("none") is None
  with pytest.raises(ValueError, match="burst_ms"):
    network.tbf_burst("1gbit", burst_ms=0)


COMMANDS = (
  "benchmarks.codecs",
  "benchmarks.compile_time",
  "benchmarks.fault",
  "benchmarks.figures",
  "benchmarks.kernels",
  "benchmarks.launch",
  "benchmarks.lm_network",
  "benchmarks.network",
  "benchmarks.overlap",
  "benchmarks.sharded",
  "benchmarks.studies.cpu_kernel_loop",
  "benchmarks.studies.demo_variants",
  "benchmarks.studies.elias",
  "benchmarks.studies.mipd",
  "benchmarks.studies.native_vs_xla",
  "benchmarks.studies.qsvrg",
  "benchmarks.studies.topk",
  "benchmarks.two_level",
  "examples.mnist1d.main",
  "examples.lm.main",
)

_HELP_ALL = """
import contextlib, io, runpy, sys
for module in sys.argv[1:]:
  sys.argv = [module, "--help"]
  out = io.StringIO()
  try:
    with contextlib.redirect_stdout(out):
      runpy.run_module(module, run_name="__main__", alter_sys=True)
  except SystemExit as e:
    code = e.code
  else:
    code = "no exit"
  print(module, code, "usage:" in out.getvalue(), sep="\\t")
"""


def test_every_command_line_prints_its_help():
  # argparse formats help strings with %: a literal % in one (a codec called 'topk0.1%')
  # must be escaped, or `--help` raises
  assert {m.split(".")[0] for m in COMMANDS} == {"benchmarks", "examples"}
  scripts = {
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for p in (ROOT / "benchmarks").rglob("*.py")
    if "argparse" in p.read_text()
  }
  assert scripts <= set(COMMANDS), scripts - set(COMMANDS)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run(
    [sys.executable, "-c", _HELP_ALL, *COMMANDS],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [line.split("\t") for line in out.stdout.splitlines() if "\t" in line]
  assert rows == [[m, "0", "True"] for m in COMMANDS], (rows, out.stderr[-3000:])


@pytest.mark.slow
@pytest.mark.once
def test_cpu_kernel_loop_builds_and_prices_the_hash():
  from jaxcomp.kernels import cpu  # pylint: disable=import-outside-toplevel

  if not cpu.available():
    pytest.skip("no C++ compiler here")
  # --against the shipped source itself: a baseline row, built from a copy.
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "benchmarks.studies.cpu_kernel_loop",
      "--log2n",
      "16",
      "--repeats",
      "3",
      "--rounds",
      "2",
      "--stream",
      "--against",
      str(cpu.SOURCE),
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    check=True,
  ).stdout
  assert "from a fresh array" in out and "median of 2 x 3" in out, out
  rows = {
    line.split("|")[1].strip(): line
    for line in out.splitlines()
    if line.startswith("| ") and "---" not in line and "build" not in line
  }
  assert set(rows) == {
    "as shipped",
    "baseline: cpu_codecs.cc",
    "without the hash",
    "without the prefetch",
  }, out
  assert rows["as shipped"].rstrip().endswith("| 1.00 |")


@pytest.mark.slow
def test_kernel_benchmark_runs(capsys):
  """benchmarks.kernels runs end to end (interpret mode: a smoke run, no timing)."""
  from benchmarks import kernels as bench  # pylint: disable=import-outside-toplevel
  from jaxcomp.kernels import cuda_available  # pylint: disable=import-outside-toplevel

  assert bench.main(["--interpret", "--sizes", "10", "--repeats", "1", "--k", "2"]) == 0
  out = capsys.readouterr().out
  for name in (
    "quantize",
    "quantize+ef",
    "dequantize_sum K=2",
    "sign_pack",
    "sign_pack+ef",
    "sign_unpack_sum K=2",
  ):
    assert f"| {name} | 2^10 |" in out
  if not cuda_available():
    assert bench.main(["--sizes", "10"]) == 2  # refuses to time interpret mode


@pytest.mark.slow
def test_mipd_capacity_counts_every_owner_within_its_capacity():
  out = subprocess.run(
    [sys.executable, "-m", "benchmarks.studies.mipd", "--steps", "3"],
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=600,
    check=True,
  ).stdout
  assert "overflow steps 0" in out, out
  rows = [line.split("|")[1:-1] for line in out.splitlines() if re.match(r"\| [12] \|", line)]
  assert len(rows) == 6, out  # two half-update groups (steps 0 and 2 take group 1) x 3 counts
  for _, name, mean, largest, capacity, above in rows:
    assert float(mean) <= int(largest) <= int(capacity), (name, out)
    assert int(above) == 0, (name, out)
  assert "24 device-steps recorded over 3 steps" in out, out  # 8 devices x 3 steps


def test_sharded_lm_flags():
  from benchmarks import sharded  # pylint: disable=import-outside-toplevel

  args = sharded.parse_args(["--model", "lm", "--part", "memory"])
  assert args.methods == list(sharded.LM_METHODS) and args.config == "deep"
  assert args.batch is None and args.out == "runs/sharded_lm"  # the config's batch
  mlp = sharded.parse_args([])
  assert mlp.methods == list(sharded.METHODS) and mlp.batch == 32 and mlp.out == "runs/sharded"
  # Each sharded method is timed against the dense method of its own kind.
  assert [sharded.lm_baseline(m) for m in sharded.LM_METHODS] == [
    "dense",
    "zero_dense",
    "zero_dense",
    "fsdp_dense",
    "fsdp_dense",
  ]
  with pytest.raises(SystemExit):  # an MLP method is not an LM method
    sharded.parse_args(["--model", "lm", "--methods", "dense,fsdp_qsgd4"])


def test_sharded_ef_flags():
  from benchmarks import sharded  # pylint: disable=import-outside-toplevel

  ef = sharded.parse_args(["--part", "ef"])
  assert ef.methods == list(sharded.EF_OPTIONS) and ef.steps == 300 and ef.batch == 32
  assert sharded.parse_args(["--part", "ef", "--methods", "qsgd4"]).methods == ["qsgd4"]
  assert sharded.parse_args([]).steps == 10  # the link part's timed steps
  for bad in (["--model", "lm"], ["--methods", "fsdp_qsgd4"]):  # no LM; an option each
    with pytest.raises(SystemExit):
      sharded.parse_args(["--part", "ef", *bad])


def test_two_level_reads_the_interface_counters(tmp_path):
  from benchmarks import two_level

  stats = tmp_path / "jcveth0" / "statistics"
  stats.mkdir(parents=True)
  (stats / "tx_bytes").write_text("1000\n")
  (stats / "rx_bytes").write_text("250\n")
  before = two_level.read_counters("jcveth0", root=str(tmp_path))
  assert before == {"tx_bytes": 1000, "rx_bytes": 250}
  (stats / "tx_bytes").write_text("4000\n")
  after = two_level.read_counters("jcveth0", root=str(tmp_path))
  assert two_level.counter_delta(before, after) == {"tx_bytes": 3000, "rx_bytes": 0}


def _two_level_record(step_s, losses, sent, wire):
  return {
    "step_times_s": [step_s] * 3,
    "losses": losses,
    "link_bytes": {"tx_bytes": 10 * sent, "rx_bytes": 10 * sent},
    "timed_steps": 10,
    "wire_slow_bytes_per_node": wire,
    "one_gradient_bytes": 8e5,
  }


def test_two_level_rows_ratios_and_marks():
  from benchmarks import two_level

  records = {
    "dense": _two_level_record(1.0, [2.3, 2.0], 8e6, 8e6),
    "flat_qsgd4": _two_level_record(0.5, [2.3, 2.1], 3e6, 2e6),
    "two_level_qsgd4": _two_level_record(0.25, [2.3, 2.1], 1e6, 1e6),
    "flat_onebit": _two_level_record(0.5, [2.3, float("nan")], 1e6, 1e6),
    "two_level_onebit": _two_level_record(0.5, [2.3, 2.2], 100, 1e6),
    "two_level_powersgd": {"status": "not supported: not yet"},
  }
  rows = two_level.rows_with_ratios(
    # both processes alike: the per-node bytes are their mean
    [two_level.row_of(m, [r, r]) for m, r in records.items()]
  )
  by = {r["method"]: r for r in rows}
  assert by["two_level_qsgd4"]["status"] == "ok"
  assert by["two_level_qsgd4"]["link_sent_per_node"] == 1e6
  assert by["two_level_qsgd4"]["speedup_vs_dense"] == 4.0
  assert by["two_level_qsgd4"]["speedup_vs_flat"] == 2.0
  assert by["two_level_qsgd4"]["bytes_vs_dense"] == 8.0
  assert by["two_level_qsgd4"]["bytes_vs_flat"] == 3.0
  assert "speedup_vs_flat" not in by["flat_qsgd4"] and "speedup_vs_dense" not in by["dense"]
  assert by["flat_onebit"]["status"] == "diverged"
  assert by["two_level_onebit"]["status"] == "sent nothing"
  assert by["two_level_powersgd"]["status"].startswith("not supported")
  text = two_level.table(rows)
  assert (
    "| two_level_qsgd4 | ok | 250.0 | 2.2000 | 1.000 | 1.000 | 1.00 | 1.25x | 4.00x | 2.00x |"
    in text
  )
  assert "| two_level_powersgd | not supported |" in text
  assert len({line.count("|") for line in text.splitlines()}) == 1  # every row complete


def test_two_level_projection_prices_each_axis_on_its_link():
  import jax
  import jax.numpy as jnp

  from benchmarks import two_level
  import jaxcomp as jc

  params = {"w": jnp.zeros((256, 128))}
  methods = ("dense", "flat_qsgd4", "two_level_qsgd4")
  proj = two_level.projection(params, methods, nodes=(4, 16), gpus=4)
  for name, by_method in proj.items():
    for n in (4, 16):
      t = {m: by_method[m][n] for m in methods}
      assert 0 < t["two_level_qsgd4"] < t["flat_qsgd4"] < t["dense"], (name, n, t)
  # dense is one psum over all 4·n devices, on the slow link
  slow = jc.network.Link(*two_level.PROJECTION_LINKS["10 Gbit/s"]["node"])
  want = slow.collective_time("psum", 256 * 128 * 4, 16 * 4)
  assert proj["10 Gbit/s"]["dense"][16] == pytest.approx(want, rel=1e-9)
  # one gradient as a compressor sends it: dense float32, 4-bit QSGD about 1/8 of that
  assert two_level.one_gradient_bytes("dense", params) == 256 * 128 * 4
  assert 7 < 256 * 128 * 4 / two_level.one_gradient_bytes("two_level_qsgd4", params) < 8
  text = two_level.projection_table(proj, gpus=4)
  assert "| two_level_qsgd4 |" in text and "16 nodes" in text
  assert jax.device_count() >= 1  # no real mesh was needed


def test_two_level_pinning_says_when_cores_are_short():
  from benchmarks import two_level

  sets, note = two_level.pinning(2, 2, 4)
  assert sets == [["taskset", "-c", "0-0"], ["taskset", "-c", "1-1"]]
  assert "only 1 core(s) for the 4 devices" in note
  sets, note = two_level.pinning(2, 16, 4)
  assert sets[1] == ["taskset", "-c", "8-15"] and "only" not in note
  assert "share cores" in two_level.pinning(4, 2, 4)[1]

"""Native CPU kernels (jaxcomp.kernels.cpu) against the XLA codecs.

Payloads bit-identical to the XLA path for the same key (QSGD with the max norm at every
code width, OneBit's sign words), decode-sums in rank order bit for bit, fused error
feedback, non-finite buckets, ragged and multi-chunk shapes, the codecs' dispatch and a
build that fails (no compiler): the default falls back to XLA, ``"native"`` says why.
"""

import os
from pathlib import Path
import platform
import subprocess
import sys
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp as jc
from jaxcomp import kernels
from jaxcomp._src.plumbing import bitpack
from jaxcomp._src.plumbing import rng
from jaxcomp.kernels import cpu
from tests import helpers
from tests import kernel_references as refs

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler here")

ROOT = Path(__file__).resolve().parents[1]
EPS = float(jnp.finfo(jnp.float32).eps)
BIG = 3 * 2**17 + 77  # several parallel chunks (2**17 values each) and a short last bucket


def _x(n, dtype=jnp.float32, seed=1):
  x = 3 * jax.random.normal(jax.random.key(seed), (n,), jnp.float32)
  return x.at[3].set(0.0).astype(dtype)  # an exact zero: its code carries no sign


def _codes(words, levels, n):
  return np.asarray(bitpack.unpack_bits(words, kernels.quantize.bits_per_value(levels), n))


# ------------------------------------------------------------------------------ QSGD


@pytest.mark.parametrize(
  "n,bucket,levels,dtype",
  [
    (2000, 64, 7, jnp.float32),  # 4-bit, ragged
    (1000, 128, 1, jnp.bfloat16),  # 2-bit codes (packed by PackLanes), bf16 input
    (77, 512, 32767, jnp.float16),  # 16-bit codes; one short bucket
    (4133, 32, 127, jnp.float32),  # 8-bit codes, the smallest bucket
    (BIG, 512, 7, jnp.float32),  # several threads
  ],
)
def test_quantize_max_norm_is_bit_identical(n, bucket, levels, dtype):
  x, key = _x(n, dtype), jax.random.key(7)
  out = jax.jit(lambda x, k: cpu.quantize(x, k, levels=levels, bucket_size=bucket))(x, key)
  ref = refs.quantize_reference(x, key, levels=levels, bucket_size=bucket)
  chex.assert_trees_all_equal(out, ref)
  assert out[0].shape == (bitpack.num_words(n, kernels.quantize.bits_per_value(levels)),)


def test_quantize_l2_norm_matches_up_to_sum_order():
  n, bucket, levels = 4096, 32, 127
  x, key = _x(n), jax.random.key(7)
  words, scales = cpu.quantize(x, key, levels=levels, bucket_size=bucket, norm="l2")
  ref_words, ref_scales = refs.quantize_reference(
    x, key, levels=levels, bucket_size=bucket, norm="l2"
  )
  np.testing.assert_allclose(scales, ref_scales, rtol=4 * EPS, atol=0)
  mine, ref = _codes(words, levels, n), _codes(ref_words, levels, n)
  mask = (1 << int(levels).bit_length()) - 1
  assert np.abs((mine & mask).astype(np.int64) - (ref & mask)).max() <= 1
  assert np.mean(mine != ref) <= 1e-3  # a flip needs u within ~1e-6 of the threshold


@pytest.mark.parametrize(
  "n,bucket,levels", [(2000, 64, 7), (BIG, 1024, 127), (300, 32, 1), (4096, 512, 7)]
)  # whole buckets only
def test_quantize_fused_error_feedback_is_bit_identical(n, bucket, levels):
  x, key = _x(n), jax.random.key(5)
  e = 0.1 * jax.random.normal(jax.random.key(2), (n,), jnp.float32)
  out = cpu.quantize(x, key, e, levels=levels, bucket_size=bucket)
  ref = refs.quantize_reference(x, key, e, levels=levels, bucket_size=bucket)
  chex.assert_trees_all_equal(out, ref)  # words, scales and e' = (x + e) - decode


@pytest.mark.parametrize("levels", [1, 7, 127])
def test_quantize_extreme_values_are_bit_identical(levels):
  # Buckets of 64: all +-max (r == s exactly, where the XLA path's clamp to s would act
  # if r ever exceeded s; the kernel has no clamp), subnormals next to a normal max,
  # -0.0, the largest finite float, and values a hair below the max.
  tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
  big = np.float32(np.finfo(np.float32).max)
  below = np.nextafter(np.float32(2.5), np.float32(0))
  buckets = [
    np.where(np.arange(64) % 3 == 0, -2.5, 2.5),
    np.concatenate([[1.0], tiny * np.arange(1, 64)]),
    np.concatenate([[-0.0, 0.0, 1e-38], np.full(61, -1e-40)]),
    np.concatenate([[big, -big], np.linspace(-1, 1, 62) * big]),
    np.concatenate([[2.5], np.full(63, below)]),
  ]
  x = jnp.asarray(np.concatenate(buckets).astype(np.float32))
  e = jnp.zeros_like(x)
  for key in (jax.random.key(0), jax.random.key(1)):
    out = cpu.quantize(x, key, e, levels=levels, bucket_size=64)
    ref = refs.quantize_reference(x, key, e, levels=levels, bucket_size=64)
    chex.assert_trees_all_equal(out, ref)


def test_two_bit_huge_bucket_takes_the_float_rounding():
  # The kernel decides QSGD's rounding in integers, from ceil(fl(x * s * k * 2**24)),
  # which equals fl(x * s * k) * 2**24 only while x * s * k is normal. With 2-bit codes
  # (s = 1) and a scale >= 2**126 (k = 1/4) it is not: here x = fl(1.0 * inv) is about
  # 1.3 * 2**-126, x / 4 flushes to 0 on XLA:CPU (code 0), but the integer rule would
  # send code 1 where u24 = 0. Seed 105 draws u24 = 0 at index 2613 (checked below).
  key, at = jax.random.key(105), 2613
  assert int(rng.bits24(key, (at + 1,))[at]) == 0
  x = np.zeros(2624, np.float32)
  x[2592] = 1.5 * 2.0**127  # the bucket's max: scale >= 2**126
  x[at] = 1.0
  x = jnp.asarray(x)
  out = cpu.quantize(x, key, levels=1, bucket_size=32)
  ref = refs.quantize_reference(x, key, levels=1, bucket_size=32)
  chex.assert_trees_all_equal(out, ref)
  assert _codes(out[0], 1, x.size)[at] == 0


_ENCODE_HARNESS = r"""
#include "cpu_codecs.cc"
#include <cstdio>
#include <cstdlib>
// argv: input.bin output.bin n bucket levels k0 k1. Writes the words, then the scales.
int main(int argc, char** argv) {
  const int64_t n = std::atoll(argv[3]), bucket = std::atoll(argv[4]), levels = std::atoll(argv[5]);
  const QsgdParams p{n, bucket, levels, false,
                     static_cast<uint32_t>(std::strtoul(argv[6], nullptr, 10)),
                     static_cast<uint32_t>(std::strtoul(argv[7], nullptr, 10))};
  std::vector<float> x(n), scratch(bucket);
  FILE* in = std::fopen(argv[1], "rb");
  if (std::fread(x.data(), sizeof(float), n, in) != static_cast<size_t>(n)) return 1;
  std::fclose(in);
  const int64_t bits = CodeBits(levels), nb = (n + bucket - 1) / bucket;
  std::vector<uint32_t> words((n * bits + 31) / 32), codes(bucket);
  std::vector<float> scales(nb);
  FlushDenormals mode;
  DispatchBits(bits, [&](auto tag) {
    constexpr int B = decltype(tag)::value;
    for (int64_t b = 0; b < nb; ++b) {
      int64_t valid;
      const float* v = LoadBucket(x.data(), nullptr, n, bucket, b, scratch.data(), &valid);
      QsgdBucket<B>(p, b, v, valid, words.data(), scales.data(), nullptr, codes.data());
    }
  });
  FILE* out = std::fopen(argv[2], "wb");
  std::fwrite(words.data(), sizeof(uint32_t), words.size(), out);
  std::fwrite(scales.data(), sizeof(float), scales.size(), out);
  std::fclose(out);
}
"""


@pytest.mark.slow
@pytest.mark.once
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags")
def test_encode_without_avx512_matches_the_xla_path(tmp_path):
  # -march=native takes the AVX-512 forms where the CPU has them (the encode's CeilToInt
  # among them); the portable fallbacks run only on other CPUs. Both builds of the
  # encode must write the XLA path's payload. The 2-bit data put r = |v| at
  # (u24 + 1/2) * 2**-24, where u24 is the value's own random draw: the code is then 1
  # only if ceil(r * 2**24) is exact (a truncation would send 0).
  key = jax.random.key(11)
  k0, k1 = (int(w) for w in rng.key_words(key))
  n, bucket = 4096, 64
  u24 = np.asarray(rng.bits24(key, (n,))).astype(np.float64)
  signs = np.where(np.arange(n) % 3 == 0, -1.0, 1.0)
  crafted = np.where(u24 < 2**23, (u24 + 0.5) * 2.0**-24, 0.25) * signs
  crafted[::bucket] = 1.0  # each bucket's max: scale 1, so r = |v| exactly
  cases = [(crafted.astype(np.float32), 1), (np.asarray(_x(n)), 7), (np.asarray(_x(n)), 127)]
  src = tmp_path / "harness.cc"
  src.write_text(_ENCODE_HARNESS)
  flags = [f for f in cpu.FLAGS if f not in ("-shared", "-fPIC")]
  for name, extra in (("native", []), ("portable", ["-mno-avx512f"])):
    exe = tmp_path / name
    subprocess.run(
      [
        *cpu._compiler(),
        *flags,
        *extra,
        "-I",
        str(cpu.SOURCE.parent),  # pylint: disable=protected-access
        "-I",
        jax.ffi.include_dir(),
        str(src),
        "-o",
        str(exe),
      ],
      check=True,
      capture_output=True,
      timeout=300,
    )
    for x, levels in cases:
      (tmp_path / "x.bin").write_bytes(x.tobytes())
      subprocess.run(
        [
          str(exe),
          str(tmp_path / "x.bin"),
          str(tmp_path / "out.bin"),
          str(n),
          str(bucket),
          str(levels),
          str(k0),
          str(k1),
        ],
        check=True,
        timeout=60,
      )
      words, scales = refs.quantize_reference(
        jnp.asarray(x), key, levels=levels, bucket_size=bucket
      )
      got = np.fromfile(tmp_path / "out.bin", np.uint32)
      np.testing.assert_array_equal(
        got[: words.size], np.asarray(words), err_msg=f"{name} {levels}"
      )
      np.testing.assert_array_equal(got[words.size :].view(np.float32), np.asarray(scales))
  # The crafted values all round up to magnitude 1 (the data test what they claim to).
  ref = refs.quantize_reference(jnp.asarray(cases[0][0]), key, levels=1, bucket_size=bucket)
  crafted_at = (u24 < 2**23) & (np.arange(n) % bucket != 0)
  assert crafted_at.sum() > n // 3
  assert np.all((_codes(ref[0], 1, n) & 1)[crafted_at] == 1)


def test_denormals_are_flushed_as_on_xla_cpu():
  # XLA:CPU computes with FTZ and DAZ (a subnormal input reads as 0, a subnormal result
  # becomes 0); the kernels set both modes themselves so their bits stay the XLA path's.
  mul = jax.jit(lambda a, b: a * b)
  assert mul(jnp.float32(1e-40), jnp.float32(1e10)) == 0  # DAZ
  assert mul(jnp.float32(1e-30), jnp.float32(1e-15)) == 0  # FTZ
  # A normal max next to subnormals: the XLA path's residual of a subnormal is 0.
  x = jnp.asarray(np.concatenate([[1e-30], np.full(63, -1e-40)]).astype(np.float32))
  e = jnp.zeros_like(x)
  out = cpu.quantize(x, jax.random.key(0), e, levels=7, bucket_size=64)
  ref = refs.quantize_reference(x, jax.random.key(0), e, levels=7, bucket_size=64)
  chex.assert_trees_all_equal(out, ref)
  assert np.all(np.asarray(out[2])[1:] == 0)


def test_quantize_nonfinite_bucket_is_marked_not_hidden():
  x = _x(300).at[70].set(jnp.nan).at[200].set(-jnp.inf)
  e = jnp.zeros((300,), jnp.float32)
  words, scales, new_e = cpu.quantize(x, jax.random.key(0), e, levels=7, bucket_size=64)
  ref = refs.quantize_reference(x, jax.random.key(0), e, levels=7, bucket_size=64)
  chex.assert_trees_all_equal((words, scales, new_e), ref)
  assert np.isnan(scales[1]) and np.isnan(scales[3])
  assert np.isfinite(np.delete(np.asarray(scales), [1, 3])).all()
  assert np.isnan(new_e[64:128]).all() and np.isfinite(new_e[:64]).all()
  # a zero bucket: zero scale, zero codes, the residual is the input
  z = cpu.quantize(jnp.zeros((64,)), jax.random.key(0), e[:64], levels=7, bucket_size=32)
  chex.assert_trees_all_equal(
    z,
    refs.quantize_reference(jnp.zeros((64,)), jax.random.key(0), e[:64], levels=7, bucket_size=32),
  )


@pytest.mark.xla_optimized
@pytest.mark.parametrize(
  "k,n,bucket,levels", [(3, 2000, 64, 7), (5, 300, 32, 127), (2, BIG, 512, 1), (1, 77, 512, 32767)]
)
def test_dequantize_sum_is_the_ordered_sum_bit_for_bit(k, n, bucket, levels):
  xs = jax.random.normal(jax.random.key(3), (k, n), jnp.float32)
  keys = jax.random.split(jax.random.key(4), k)
  words, scales = jax.vmap(
    lambda x, kk: refs.quantize_reference(x, kk, levels=levels, bucket_size=bucket)
  )(xs, keys)
  out = cpu.dequantize_sum(words, scales, n=n, levels=levels, bucket_size=bucket)
  ref = refs.dequantize_sum_reference(words, scales, n=n, levels=levels, bucket_size=bucket)
  chex.assert_trees_all_equal(out, ref)


# --------------------------------------------------------------------------- 1-bit SGD


@pytest.mark.parametrize(
  "n,bucket,dtype,feedback",
  [
    (2000, 64, jnp.float32, True),
    (1000, 128, jnp.bfloat16, False),
    (77, 512, jnp.float32, True),
    (BIG, 1024, jnp.float32, True),
  ],
)
def test_sign_pack_matches_onebit(n, bucket, dtype, feedback):
  x = _x(n, dtype)
  e = 0.1 * jax.random.normal(jax.random.key(2), (n,), jnp.float32) if feedback else None
  if e is not None and dtype != jnp.float32:
    pytest.skip("fused feedback is float32 only")
  out = cpu.sign_pack(x, e, bucket_size=bucket)
  ref = refs.sign_pack_reference(x, e, bucket_size=bucket)
  chex.assert_trees_all_equal(out[0], ref[0])  # the sign words: bit for bit
  # The means are sums in another order: a few ulp of the bucket's largest value.
  scale = float(jnp.max(jnp.abs(x.astype(jnp.float32) + (0.0 if e is None else e))))
  for mine, theirs in zip(out[1:], ref[1:]):
    np.testing.assert_allclose(mine, theirs, rtol=0, atol=4 * EPS * scale)


def test_sign_pack_nonfinite_and_signed_zero():
  x = jnp.array([-0.0, 0.0, 1.0, -2.0] * 16, jnp.float32)  # 64 values, 2 buckets
  words, pos, neg = cpu.sign_pack(x, bucket_size=32)
  chex.assert_trees_all_equal(words, refs.sign_pack_reference(x, bucket_size=32)[0])
  # -0.0 counts as non-negative: 24 of each 32 values, summing to 8
  np.testing.assert_array_equal(pos, np.float32(8) / np.float32(24) * np.ones(2, np.float32))
  np.testing.assert_array_equal(neg, [-2.0, -2.0])
  _, pos, neg = cpu.sign_pack(x.at[40].set(jnp.nan), bucket_size=32)
  assert np.isfinite(pos[0]) and np.isnan(pos[1]) and np.isnan(neg[1])


@pytest.mark.parametrize("k,n,bucket", [(1, 2000, 64), (6, 77, 512), (2, BIG, 32)])
def test_sign_unpack_sum_is_the_ordered_sum(k, n, bucket):
  xs = jax.random.normal(jax.random.key(3), (k, n), jnp.float32)
  words, pos, neg = jax.vmap(lambda x: refs.sign_pack_reference(x, bucket_size=bucket))(xs)
  out = cpu.sign_unpack_sum(words, pos, neg, n=n, bucket_size=bucket)
  ref = refs.sign_unpack_sum_reference(words, pos, neg, n=n, bucket_size=bucket)
  chex.assert_trees_all_equal(out, ref)


# ------------------------------------------------------------------- dispatch, checks


def _has_native_call(fn, *args) -> bool:
  return "jaxcomp_cpu_" in jax.jit(fn).lower(*args).as_text()


def test_codecs_pick_the_native_kernels_on_cpu():
  x, key = _x(1024), jax.random.key(0)
  for codec_cls, kw in (
    (jc.codecs.QSGD, dict(levels=7, bucket_size=64, norm="max")),
    (jc.codecs.OneBit, dict(bucket_size=64)),
  ):
    default = codec_cls(**kw)
    assert _has_native_call(lambda x: default.decode(default.encode(x, key=key)), x) == (
      cpu.use_by_default()
    )
    assert _has_native_call(
      lambda x: codec_cls(**kw, implementation="native").encode(x, key=key), x
    )
    assert not _has_native_call(
      lambda x: codec_cls(**kw, implementation="xla").encode(x, key=key), x
    )
    native = codec_cls(**kw, implementation="native")
    assert native.fuses_feedback(1024, jnp.float32)
    assert not native.fuses_feedback(1024, jnp.bfloat16)  # fl_bf16(x + e): the unfused path
  # Shapes the kernels cannot handle fall back to XLA: the XLA path's payload and decode.
  for make in (
    lambda impl: jc.codecs.QSGD(3, 64, "max", implementation=impl),  # 3-bit
    lambda impl: jc.codecs.QSGD(7, 100, "max", implementation=impl),  # bucket
    lambda impl: jc.codecs.OneBit(None, implementation=impl),
  ):  # one bucket
    codec, xla = make("native"), make("xla")
    assert not _has_native_call(lambda x: codec.encode(x, key=key), x)
    payload = codec.encode(x, key=key)
    chex.assert_trees_all_equal(payload, xla.encode(x, key=key))
    chex.assert_trees_all_equal(codec.decode(payload), xla.decode(payload))
  p = jc.codecs.QSGD(7, 128, "max", implementation="native").encode(_x(1500, jnp.bfloat16), key=key)
  chex.assert_trees_all_equal(
    p, jc.codecs.QSGD(7, 128, "max", implementation="xla").encode(_x(1500, jnp.bfloat16), key=key)
  )
  with pytest.raises(ValueError, match="does not handle"):
    cpu.quantize(x, key, levels=3, bucket_size=64)
  with pytest.raises(ValueError, match="does not handle"):
    cpu.sign_unpack_sum(
      jnp.zeros((1, 32), jnp.uint32),
      jnp.zeros((1, 11)),
      jnp.zeros((1, 11)),
      n=1024,
      bucket_size=100,
    )
  with pytest.raises(ValueError, match="float32 x"):
    cpu.quantize(x.astype(jnp.bfloat16), key, x, levels=7, bucket_size=64)
  with pytest.raises(ValueError, match="residual shape"):
    cpu.sign_pack(x, x[:10], bucket_size=64)


def test_the_kernel_checks_payload_shapes():
  # Shapes that the Python wrapper would not produce reach the C++ checks.
  bad = jax.ffi.ffi_call("jaxcomp_cpu_qsgd_decode_sum", jax.ShapeDtypeStruct((1000,), jnp.float32))
  with pytest.raises(Exception, match="payload shapes do not match"):
    bad(
      jnp.zeros((1, 7), jnp.uint32),
      jnp.zeros((1, 16), jnp.float32),
      levels=np.int64(7),
      bucket=np.int64(64),
    ).block_until_ready()


@pytest.mark.xla_optimized
@pytest.mark.slow
@pytest.mark.parametrize(
  "make",
  [
    lambda impl: jc.codecs.QSGD(7, 64, "max", implementation=impl),
    lambda impl: jc.codecs.OneBit(64, implementation=impl),
  ],
  ids=["qsgd", "onebit"],
)
def test_compress_native_under_pmap_and_shard_map(make):
  """8 devices, fused error feedback + fused decode-sum vs the XLA path, two steps."""
  params, grads, _, _ = helpers.kernel_vs_xla_under_pmap(
    make, "native", bitwise_outputs=isinstance(make("xla"), jc.codecs.QSGD)
  )

  # shard_map (check_vma on): the same first step
  m = helpers.mesh()
  spec = jax.sharding.PartitionSpec(helpers.AXIS)
  tx = jc.compress(
    make("native"),
    axis_name=helpers.AXIS,
    error_feedback=True,
    filter=lambda path, leaf: True,
    collective="allgather",
  )
  state = jax.pmap(lambda _: tx.init(params), axis_name=helpers.AXIS)(jnp.arange(8))

  def one(g, s):
    out, s = tx.update(jax.tree.map(lambda a: a[0], g), jax.tree.map(lambda a: a[0], s))
    return jax.tree.map(lambda a: a[None], out)

  sharded = jax.jit(jax.shard_map(one, mesh=m, in_specs=(spec, spec), out_specs=spec))
  out_s = sharded(helpers.shard(grads, m), helpers.shard(state, m))
  out_p, _ = jax.pmap(tx.update, axis_name=helpers.AXIS)(grads, state)
  chex.assert_trees_all_equal(out_s, out_p)


def test_a_failed_build_falls_back_to_xla_and_native_says_why(tmp_path):
  """No compiler: the default codec runs the XLA path; "native" raises the reason."""
  script = (
    "import jax, jax.numpy as jnp\n"
    "import jaxcomp as jc\n"
    "from jaxcomp.kernels import cpu\n"
    "assert not cpu.available() and not cpu.use_by_default()\n"
    "q = jc.codecs.QSGD(7, 64)\n"
    "x = jnp.arange(256.0)\n"
    "assert q.kernel_backend(256) is None\n"
    "q.decode(q.encode(x, key=jax.random.key(0)))\n"
    "try:\n"
    "  jc.codecs.OneBit(64, implementation='native').encode(x)\n"
    "except cpu.BuildError as e:\n"
    "  print('BuildError:', e)\n"
  )
  env = dict(
    os.environ, CXX="no-such-compiler-jaxcomp", JAXCOMP_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu"
  )
  done = subprocess.run(
    [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert "BuildError: no C++ compiler: no-such-compiler-jaxcomp not found" in done.stdout


def test_turned_off_by_environment():
  env = dict(os.environ, JAXCOMP_NATIVE="0", JAX_PLATFORMS="cpu")
  done = subprocess.run(
    [
      sys.executable,
      "-c",
      "from jaxcomp.kernels import cpu\nprint(cpu.available(), cpu.use_by_default())",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.stdout.split() == ["True", "False"], done.stderr[-3000:]


def test_library_is_cached_by_content(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXCOMP_CACHE_DIR", str(tmp_path))
  path = cpu.library_path()
  assert path.parent == tmp_path and path.name.startswith("cpu_codecs-")
  assert path.stat().st_size > 0 and list(tmp_path.iterdir()) == [path]  # no temp files left
  assert cpu.library_path() == path  # found, not rebuilt
  monkeypatch.setenv("CXX", "c++ -DJAXCOMP_UNUSED_MACRO")  # another compiler command
  other = cpu.library_path()
  assert other != path and sorted(tmp_path.iterdir()) == sorted([path, other])
  # A library's mtime is its last use: finding it again touches it (prune keeps it).
  old = time.time() - 30 * 86400
  os.utime(path, (old, old))
  monkeypatch.setenv("CXX", "c++")
  assert cpu.library_path() == path and time.time() - path.stat().st_mtime < 3600


def test_prune_removes_only_stale_libraries(tmp_path):
  keep = tmp_path / "cpu_codecs-current.so"
  names = [
    "cpu_codecs-stale.so",
    "cpu_codecs-recent.so",
    "tmpabc123.so",
    "tmpfresh.so",
    "unrelated.so",
    "cpu_codecs-stale.txt",
  ]
  for f in [keep, *(tmp_path / n for n in names)]:
    f.write_bytes(b"x")
  old = time.time() - cpu.PRUNE_AGE_S - 60
  for n in ("cpu_codecs-stale.so", "tmpabc123.so", "unrelated.so", "cpu_codecs-stale.txt"):
    os.utime(tmp_path / n, (old, old))
  os.utime(keep, (old, old))  # the current one stays, however old
  removed = cpu.prune(keep)
  assert sorted(f.name for f in removed) == ["cpu_codecs-stale.so", "tmpabc123.so"]
  assert sorted(f.name for f in tmp_path.iterdir()) == sorted(
    [
      "cpu_codecs-current.so",
      "cpu_codecs-recent.so",
      "tmpfresh.so",
      "unrelated.so",
      "cpu_codecs-stale.txt",
    ]
  )

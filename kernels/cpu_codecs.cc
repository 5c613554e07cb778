// Native CPU kernels of QSGD and 1-bit SGD, called from XLA as FFI custom calls.
//
// Built on first use by jaxcomp.kernels.cpu (the system C++ compiler, -O3 -march=native,
// -ffp-contract=off: no fused multiply-adds, so every float operation rounds as XLA's
// does). What each kernel writes is, bit for bit, the payload of the XLA path of
// jaxcomp.codecs.QSGD / OneBit (OneBit's means, and QSGD's l2 scales, up to the order of
// a sum inside a bucket): see jaxcomp/kernels/cpu.py and tests/test_cpu_kernels.py.
//
// Why: XLA:CPU runs each fusion as its own pass over memory and runs reductions with
// fused inputs slower than elementwise loops, so the XLA path reads a QSGD input once
// per pass (scale, hash, quantize and pack, decode); these kernels take one bucket at a
// time while it sits in L1 (python -m benchmarks.codecs compares the two:
// docs/benchmarks.md#codec-throughput-on-cpu).
//
// Layouts (jaxcomp._src.plumbing.bitpack's lanes layout): code k of word w holds value
// w * (32 / bits) + k in bits k*bits .. k*bits + bits - 1. Buckets are a power of two
// of 32..65536 values, so every bucket is whole words; the last bucket is zero-padded.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxBucket = 65536;
// Values per chunk of a parallel call: smaller tensors run on the calling thread.
constexpr int64_t kMinValuesPerThread = int64_t{1} << 17;

// Bits of a QSGD code: ceil(log2(levels + 1)) magnitude bits and a sign bit.
inline int64_t CodeBits(int64_t levels) {
  int64_t m = 0;
  while ((int64_t{1} << m) <= levels) ++m;
  return m + 1;
}

// XLA:CPU computes with denormals flushed to zero (FTZ and DAZ in MXCSR, on the threads
// that run these kernels too); the kernels set both themselves, so that their bits are
// the XLA path's whatever state a calling thread is in. (Elsewhere than x86 they run in
// the thread's mode.)
class FlushDenormals {
 public:
#if defined(__SSE__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

// Runs fn(first_bucket, end_bucket) over [0, buckets) in contiguous chunks on XLA's
// intra-op thread pool, the calling thread included. Deadlock-free when the caller is a
// pool thread itself: chunks are claimed from a shared counter, and the caller waits only
// for chunks that a running thread has claimed; a helper that starts after all chunks are
// claimed exits without touching fn (so fn's references may be gone by then).
template <class Fn>
void ParallelBuckets(ffi::ThreadPool& pool, int64_t buckets, int64_t bucket, Fn fn) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunks = std::max<int64_t>(
      1, std::min({threads, buckets, buckets * bucket / kMinValuesPerThread}));
  if (chunks == 1) {
    FlushDenormals mode;
    fn(0, buckets);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  auto work = [state, chunks, buckets, fnp = &fn]() {
    FlushDenormals mode;
    for (int64_t c; (c = state->next.fetch_add(1)) < chunks;) {
      (*fnp)(buckets * c / chunks, buckets * (c + 1) / chunks);
      if (state->done.fetch_add(1) + 1 == chunks) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  for (int64_t t = 1; t < chunks; ++t) pool.Schedule(decltype(work)(work));
  work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == chunks; });
}

// The bucket's values as float32: x itself for a whole bucket without residual, else
// `scratch` filled with x (+ residual) and zero-padded past n. Sets *valid to the number
// of real values.
inline const float* LoadBucket(const float* x, const float* e, int64_t n, int64_t bucket,
                               int64_t b, float* scratch, int64_t* valid) {
  const int64_t start = b * bucket;
  *valid = std::min(bucket, n - start);
  if (e == nullptr && *valid == bucket) return x + start;
  if (e != nullptr) {
    for (int64_t j = 0; j < *valid; ++j) scratch[j] = x[start + j] + e[start + j];
  } else {
    std::memcpy(scratch, x + start, *valid * sizeof(float));
  }
  for (int64_t j = *valid; j < bucket; ++j) scratch[j] = 0.0f;
  return scratch;
}

// kLanes float32 / int32 / uint32 lanes (GCC/Clang vector extensions: two AVX2 or one
// AVX-512 register with -march=native, four SSE or NEON registers elsewhere). Loads and
// stores go through memcpy: no alignment is assumed. Buckets hold >= 32 values, so a
// bucket is whole vectors.
constexpr int kLanes = 16;
typedef float VF __attribute__((vector_size(4 * kLanes)));
typedef int32_t VI __attribute__((vector_size(4 * kLanes)));
typedef uint32_t VU __attribute__((vector_size(4 * kLanes)));

inline VF LoadF(const float* p) { VF r; std::memcpy(&r, p, sizeof(r)); return r; }
inline VU LoadU(const uint32_t* p) { VU r; std::memcpy(&r, p, sizeof(r)); return r; }
inline void Store(float* p, VF v) { std::memcpy(p, &v, sizeof(v)); }
inline void Store(uint32_t* p, VU v) { std::memcpy(p, &v, sizeof(v)); }
inline VF SplatF(float a) { return VF{} + a; }
inline VU SplatU(uint32_t a) { return VU{} + a; }
inline VU Iota() {
  VU r;
  for (int l = 0; l < kLanes; ++l) r[l] = static_cast<uint32_t>(l);
  return r;
}
inline float SumLanes(VF v) {  // a fixed pairwise order
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) v[l] = v[l] + v[l + width];
  return v[0];
}

// a * b + c with one rounding where the CPU has FMA, two otherwise: what XLA:CPU computes
// for `acc + q * step` (LLVM contracts the two into an FMA where it can), so a K-payload
// decode-sum agrees with the XLA path's bit for bit (-ffp-contract=off keeps every other
// expression unfused, as XLA leaves them).
inline VF MulAdd(VF a, VF b, VF c) {
#if defined(__AVX512F__)
  static_assert(kLanes == 16);
  return reinterpret_cast<VF>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a),
                                              reinterpret_cast<__m512>(b),
                                              reinterpret_cast<__m512>(c)));
#elif defined(__FMA__)
  VF r;
  for (int h = 0; h < kLanes; h += 8) {
    __m256 x, y, z;
    std::memcpy(&x, &a[h], 32);
    std::memcpy(&y, &b[h], 32);
    std::memcpy(&z, &c[h], 32);
    const __m256 f = _mm256_fmadd_ps(x, y, z);
    std::memcpy(&r[h], &f, 32);
  }
  return r;
#elif defined(__ARM_FEATURE_FMA)
  VF r;
  for (int l = 0; l < kLanes; ++l) r[l] = std::fma(a[l], b[l], c[l]);
  return r;
#else
  return a * b + c;
#endif
}

// ceil(x) as int32, for 0 <= x < 2**31 (one conversion with AVX-512's embedded
// rounding; truncation and a compare elsewhere: x >= 2**24 is an integer already).
inline VI CeilToInt(VF x) {
#if defined(__AVX512F__)
  static_assert(kLanes == 16);
  return reinterpret_cast<VI>(_mm512_cvt_roundps_epi32(reinterpret_cast<__m512>(x),
                                                      _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC));
#else
  const VI t = __builtin_convertvector(x, VI);
  return t - (__builtin_convertvector(t, VF) < x);  // a true compare is -1
#endif
}

// max |v| over a bucket and whether all its values are finite. On the bit patterns with
// the sign cleared, integer order is float order, and Inf and NaN are exactly the
// patterns >= 0x7F800000; so one integer max gives both. Buckets hold >= 32 values:
// whole pairs of vectors, one accumulator each.
inline float AbsMaxFinite(const float* v, int64_t bucket, bool* finite) {
  VI m0 = VI{}, m1 = VI{};
  for (int64_t j = 0; j < bucket; j += 2 * kLanes) {
    const VI b0 = reinterpret_cast<VI>(LoadF(v + j)) & 0x7FFFFFFF;
    const VI b1 = reinterpret_cast<VI>(LoadF(v + j + kLanes)) & 0x7FFFFFFF;
    m0 = m0 > b0 ? m0 : b0;
    m1 = m1 > b1 ? m1 : b1;
  }
  m0 = m0 > m1 ? m0 : m1;
  int32_t bits = 0;
  for (int l = 0; l < kLanes; ++l) bits = std::max(bits, m0[l]);
  *finite = bits < 0x7F800000;
  float amax;
  std::memcpy(&amax, &bits, sizeof(amax));
  return amax;
}

// Packs `words` words of BITS-bit codes (32 / BITS codes each), lanes layout.
template <int BITS>
inline void PackLanes(const uint32_t* codes, int64_t words, uint32_t* out) {
  constexpr int kPerWord = 32 / BITS;
  for (int64_t w = 0; w < words; ++w) {
    uint32_t word = 0;
    for (int k = 0; k < kPerWord; ++k) word |= codes[w * kPerWord + k] << (k * BITS);
    out[w] = word;
  }
}

// The BITS-bit codes of kLanes consecutive values starting at value j0 (a multiple of
// kLanes) of a bucket whose words start at `w` (padded so that kLanes words can be read
// past any position).
template <int BITS>
struct LaneUnpacker {
  static constexpr int kPerWord = 32 / BITS;
  VU lane_shift;  // l * BITS: lane l's shift when the codes share a word
  VU wrap_shift;  // (l % per_word) * BITS: when they span kLanes / per_word words
  VI word_of;     // l / per_word: lane l's word, counted from j0 / per_word
  LaneUnpacker() {
    for (int l = 0; l < kLanes; ++l) {
      lane_shift[l] = static_cast<uint32_t>(l * BITS);
      wrap_shift[l] = static_cast<uint32_t>((l % kPerWord) * BITS);
      word_of[l] = l / kPerWord;
    }
  }
  VU operator()(const uint32_t* w, int64_t j0) const {
    const VU mask = SplatU(BITS == 32 ? 0xFFFFFFFFu : (1u << BITS) - 1u);
    const int64_t first = j0 / kPerWord;
    if constexpr (kPerWord >= kLanes) {  // the lanes share one word
      const uint32_t offset = static_cast<uint32_t>((j0 % kPerWord) * BITS);
      return (SplatU(w[first]) >> (SplatU(offset) + lane_shift)) & mask;
    } else {
      return (__builtin_shuffle(LoadU(w + first), word_of) >> wrap_shift) & mask;
    }
  }
};

template <class Fn>
void DispatchBits(int64_t bits, Fn fn) {
  switch (bits) {
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 8: fn(std::integral_constant<int, 8>{}); break;
    default: fn(std::integral_constant<int, 16>{}); break;
  }
}

inline bool ValidBucket(int64_t bucket) {
  return bucket >= 32 && bucket <= kMaxBucket && (bucket & (bucket - 1)) == 0;
}

// ------------------------------------------------------------------------------ QSGD

struct QsgdParams {
  int64_t n, bucket, levels;
  bool l2;
  uint32_t k0, k1;
};

// kernels/_common.inverse_scale: k = 1/4 for a scale >= 2**126, else 1, and
// inv = fl(1 / (scale * k)), a normal float; |v| / scale is computed as |v| * inv
// (times 1/k), which is what XLA compiles a division by a broadcast scale into.
struct InverseScale {
  float k, inv;
  explicit InverseScale(float scale)
      : k(scale >= 0x1p126f ? 0.25f : 1.0f), inv(1.0f / (scale * k)) {}
};

// Vectors per iteration of QSGD's encode loop (QsgdVectors); buckets hold >= 2 vectors.
constexpr int kInterleave = 2;

// The codes (and residuals, when HAS_E) of one bucket with a positive scale,
// kInterleave vectors at a time. Every step is written as a loop over those vectors,
// so the compiled code runs independent dependency chains side by side (what the
// CPU's out-of-order window did not find by itself across iterations). WHOLE: every
// value and word of the bucket is in range, so the stores need no tail checks (and the
// loop no calls: with them GCC spilled the vectors to the stack).
template <int BITS, bool WHOLE, bool HAS_E, bool INT_ROUND>
inline void QsgdVectors(const QsgdParams& p, int64_t b, const float* v, int64_t valid,
                        int64_t bucket_words, float inv, float s_k, VF step,
                        uint32_t* out_words, float* out_e, uint32_t* codes,
                        const float* ahead_x, const float* ahead_e) {
  constexpr int kMbits = BITS - 1;
  constexpr int kPerWord = 32 / BITS;
  constexpr int U = kInterleave;
  const int64_t bucket = p.bucket;
  const VU lane = Iota();
  const uint32_t base = static_cast<uint32_t>(b * bucket);
  const VF inv_v = SplatF(inv), s_k_v = SplatF(s_k);
  const VF s_k24_v = SplatF(s_k * 16777216.0f);  // exact: a power of two times s * k
  const VF one = SplatF(1.0f), zero = SplatF(0.0f);
  const VU k0 = SplatU(p.k0), k1 = SplatU(p.k1);
  // Whole vectors of words are written in place; the last bucket's short tail via
  // tail_words (2-bit codes go through `codes`, for PackLanes).
  uint32_t tail_words[kLanes * BITS / 32 > 0 ? kLanes * BITS / 32 : 1];
  VU index[U];  // the values' flat indices, advanced by U * kLanes per iteration
  for (int u = 0; u < U; ++u) index[u] = SplatU(base + static_cast<uint32_t>(u * kLanes)) + lane;
  for (int64_t j0 = 0; j0 < bucket; j0 += U * kLanes) {
    VF a[U], x[U], magf[U];
    VU h[U];
    VI mag[U], neg[U];
#define JAXCOMP_EACH _Pragma("GCC unroll 8") for (int u = 0; u < U; ++u)
    JAXCOMP_EACH a[u] = LoadF(v + j0 + u * kLanes);
    // The next bucket's lines (one per vector), spread over this bucket's arithmetic.
    if (ahead_x != nullptr) JAXCOMP_EACH __builtin_prefetch(ahead_x + j0 + u * kLanes);
    if (ahead_e != nullptr) JAXCOMP_EACH __builtin_prefetch(ahead_e + j0 + u * kLanes);
    // r = |v| / scale * s as fl(fl(|v| * inv) * fl(s * k)) (kernels/_common.level_ratio);
    // x = fl(|v| * inv) here.
    JAXCOMP_EACH x[u] = reinterpret_cast<VF>(reinterpret_cast<VI>(a[u]) & 0x7FFFFFFF) * inv_v;
    // The counter hash of the flat index, mix32(mix32(i ^ k0) ^ k1), step by step:
    // Wellons' lowbias32 (jaxcomp._src.plumbing.rng.mix32).
    JAXCOMP_EACH h[u] = index[u] ^ k0;
    JAXCOMP_EACH index[u] += static_cast<uint32_t>(U * kLanes);
#ifndef JAXCOMP_ABLATE_HASH
    for (int round = 0; round < 2; ++round) {
      JAXCOMP_EACH h[u] ^= h[u] >> 16;
      JAXCOMP_EACH h[u] *= 0x7FEB352Du;
      JAXCOMP_EACH h[u] ^= h[u] >> 15;
      JAXCOMP_EACH h[u] *= 0x846CA68Bu;
      JAXCOMP_EACH h[u] ^= h[u] >> 16;
      if (round == 0) JAXCOMP_EACH h[u] ^= k1;
    }
#endif  // else benchmarks/studies/cpu_kernel_loop.py only: what the hash costs (wrong payloads)
    // The XLA path's rule: with u24 = h >> 8, round r up when u24 < frac(r) * 2**24
    // (u24 < 2**24 converts to float exactly). No clamp to s (the XLA path's jnp.minimum
    // never acts): m * fl(1 / m) <= 1 for every float32 m (tests/test_codecs.py checks
    // every mantissa), so |v| * inv <= 1 / k and r <= s; at r == s the fraction is 0.
    if constexpr (INT_ROUND) {
      // The same decision in integers. F = r * 2**24 is exact (a power of two, r normal
      // or 0), and with L = floor(r) * 2**24, frac(r) * 2**24 = F - L. For an integer
      // u24: u24 < F - L  <=>  u24 < ceil(F) - L  <=>  ceil(F) + (2**24 - 1 - u24) >=
      // L + 2**24; so the code is (ceil(F) + (~h >> 8)) >> 24. One multiply gives F:
      // fl(x * fl(s * k * 2**24)) = fl(x * fl(s * k)) * 2**24 while both are normal, and
      // INT_ROUND requires s * k >= 1 (x is normal or 0). ceil(F) + 2**24 - 1 < 2**31
      // needs s < 128: codes of at most 8 bits.
      static_assert(BITS <= 8);
      JAXCOMP_EACH {
        const VU c = reinterpret_cast<VU>(CeilToInt(x[u] * s_k24_v));
        mag[u] = reinterpret_cast<VI>((c + (~h[u] >> 8)) >> 24);
      }
      if constexpr (HAS_E) JAXCOMP_EACH magf[u] = __builtin_convertvector(mag[u], VF);
    } else {
      JAXCOMP_EACH {
        const VF r = x[u] * s_k_v;
        // floor(r) for 0 <= r <= s < 2**31: truncation toward zero is exact.
        const VF low = __builtin_convertvector(__builtin_convertvector(r, VI), VF);
        const VF u24 = __builtin_convertvector(reinterpret_cast<VI>(h[u] >> 8), VF);
        magf[u] = u24 < (r - low) * 16777216.0f ? low + one : low;
        mag[u] = __builtin_convertvector(magf[u], VI);
      }
    }
    JAXCOMP_EACH {
      const int64_t j = j0 + u * kLanes;
      neg[u] = (a[u] < zero) & (mag[u] > 0);  // a zero code carries no sign
      const VU code = reinterpret_cast<VU>(mag[u] | (neg[u] & (1 << kMbits)));
      if constexpr (BITS >= 4) {
        // Lanes 2m and 2m+1 as one uint64: c0 | c1 << BITS, then narrowed to 2*BITS bits
        // per pair (little-endian: the lanes layout's words, in order).
        typedef uint64_t V64 __attribute__((vector_size(4 * kLanes)));
        typedef std::conditional_t<BITS == 4, uint8_t,
                                   std::conditional_t<BITS == 8, uint16_t, uint32_t>> Half;
        typedef Half VH __attribute__((vector_size(sizeof(Half) * kLanes / 2)));
        const V64 pair = reinterpret_cast<V64>(code);
        const VH packed = __builtin_convertvector(pair | (pair >> (32 - BITS)), VH);
        const int64_t w = j / kPerWord;
        if (WHOLE || w + static_cast<int64_t>(sizeof(VH) / 4) <= bucket_words) {
          std::memcpy(out_words + w, &packed, sizeof(VH));
        } else if (w < bucket_words) {
          std::memcpy(tail_words, &packed, sizeof(VH));
          std::memcpy(out_words + w, tail_words, (bucket_words - w) * sizeof(uint32_t));
        }
      } else {
        Store(codes + j, code);
      }
    }
    if constexpr (HAS_E) {
      JAXCOMP_EACH {
        const int64_t j = j0 + u * kLanes;
        const VF e = a[u] - (neg[u] != 0 ? -magf[u] : magf[u]) * step;
        if (WHOLE || j + kLanes <= valid) {
          Store(out_e + j, e);
        } else if (j < valid) {
          float tail[kLanes];
          Store(tail, e);
          std::memcpy(out_e + j, tail, (valid - j) * sizeof(float));
        }
      }
    }
#undef JAXCOMP_EACH
  }
}

// One bucket of BITS-bit codes: its scale, its words, and (when new_e) the new residual
// v - Q(v). Mirrors QSGD.quantize / encode / dequantize of jaxcomp/_src/codecs/base.py.
template <int BITS>
void QsgdBucket(const QsgdParams& p, int64_t b, const float* v, int64_t valid,
                uint32_t* words, float* scales, float* new_e, uint32_t* codes,
                const float* ahead_x = nullptr, const float* ahead_e = nullptr) {
  constexpr int kPerWord = 32 / BITS;
  const int64_t bucket = p.bucket;
  const float s = static_cast<float>(p.levels);
  bool finite;
  const float amax = AbsMaxFinite(v, bucket, &finite);
  float scale = amax;
  if (p.l2) {  // amax * sqrt(sum((v / amax)^2)): no overflow or underflow of the squares
    const InverseScale is(amax > 0.0f ? amax : 1.0f);
    const VF inv = SplatF(is.inv);
    VF acc = SplatF(0.0f);
    for (int64_t j = 0; j < bucket; j += kLanes) {
      const VF w = LoadF(v + j) * inv;
      acc += w * w;
    }
    scale = amax * is.k * std::sqrt(SumLanes(acc));
  }
  if (!finite) scale = std::numeric_limits<float>::quiet_NaN();  // decodes to NaN
  scales[b] = scale;

  const int64_t first_word = b * bucket / kPerWord;
  const int64_t bucket_words = std::min<int64_t>(bucket / kPerWord,
                                                 (p.n * BITS + 31) / 32 - first_word);
  uint32_t* out_words = words + first_word;
  if (!(scale > 0.0f)) {  // a zero or NaN scale: zero codes
    std::memset(out_words, 0, bucket_words * sizeof(uint32_t));
  }
  const VF step = SplatF(scale * (1.0f / s));  // kernels/_common.level_step
  float* out_e = new_e != nullptr ? new_e + b * bucket : nullptr;
  if (scale > 0.0f) {
    const InverseScale is(scale);
    const bool whole = valid == bucket && bucket_words == bucket / kPerWord;
    using Yes = std::true_type;
    using No = std::false_type;
    const auto vectors = [&](auto whole_tag, auto has_e_tag, auto int_round_tag) {
      QsgdVectors<BITS, decltype(whole_tag)::value, decltype(has_e_tag)::value,
                  decltype(int_round_tag)::value>(p, b, v, valid, bucket_words, is.inv,
                                                  s * is.k, step, out_words, out_e, codes,
                                                  ahead_x, ahead_e);
    };
    const auto run = [&](auto whole_tag, auto has_e_tag) {
      // The integer rounding (QsgdVectors) where it is exact; a 2-bit bucket with a scale
      // >= 2**126 (s * k = 1/4) takes the float one.
      if constexpr (BITS <= 8) {
        if (s * is.k >= 1.0f) return vectors(whole_tag, has_e_tag, Yes{});
      }
      vectors(whole_tag, has_e_tag, No{});
    };
    if (whole) {
      out_e != nullptr ? run(Yes{}, Yes{}) : run(Yes{}, No{});
    } else {
      out_e != nullptr ? run(No{}, Yes{}) : run(No{}, No{});
    }
    if constexpr (BITS < 4) PackLanes<BITS>(codes, bucket_words, out_words);
  } else if (out_e != nullptr) {  // v - 0 * NaN (or * 0): NaN for a NaN scale, else v
    for (int64_t j = 0; j < valid; ++j) out_e[j] = v[j] - 0.0f * step[0];
  }
}

ffi::Error QsgdEncode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> residual,
                      ffi::Buffer<ffi::U32> key_words, int64_t levels, int64_t bucket,
                      int64_t l2, ffi::ResultBuffer<ffi::U32> words,
                      ffi::ResultBuffer<ffi::F32> scales,
                      ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = x.element_count();
  const int64_t bits = CodeBits(levels);
  if (!ValidBucket(bucket))
    return ffi::Error::InvalidArgument("bucket must be a power of two in 32..65536");
  if (bits != 2 && bits != 4 && bits != 8 && bits != 16)
    return ffi::Error::InvalidArgument("codes must be 2, 4, 8 or 16 bits");
  const int64_t nb = (n + bucket - 1) / bucket;
  const bool has_e = residual.element_count() != 0;
  if (key_words.element_count() != 2 || words->element_count() != (n * bits + 31) / 32 ||
      scales->element_count() != nb ||
      (has_e && (residual.element_count() != n || new_residual->element_count() != n)) ||
      (!has_e && new_residual->element_count() != 0))
    return ffi::Error::InvalidArgument("qsgd_encode: buffer sizes do not match");
  const QsgdParams p{n, bucket, levels, l2 != 0, key_words.typed_data()[0],
                     key_words.typed_data()[1]};
  const float* xd = x.typed_data();
  const float* ed = has_e ? residual.typed_data() : nullptr;
  uint32_t* wd = words->typed_data();
  float* sd = scales->typed_data();
  float* nd = has_e ? new_residual->typed_data() : nullptr;
  DispatchBits(bits, [&](auto bits_tag) {
    constexpr int BITS = decltype(bits_tag)::value;
    ParallelBuckets(pool, nb, bucket, [&](int64_t first, int64_t end) {
      std::vector<float> scratch(bucket);
      std::vector<uint32_t> codes(bucket);
      for (int64_t b = first; b < end; ++b) {
        int64_t valid;
        const float* v = LoadBucket(xd, ed, n, bucket, b, scratch.data(), &valid);
        // Software prefetch of the next (whole) bucket: without it the encode waits on
        // memory in AbsMaxFinite (benchmarks/studies/cpu_kernel_loop.py --stream measures it:
        // docs/guides/kernels.md#native-qsgd-encode-loop).
        const bool ahead = (b + 2) * bucket <= n;
        QsgdBucket<BITS>(p, b, v, valid, wd, sd, nd, codes.data(),
                         ahead ? xd + (b + 1) * bucket : nullptr,
                         ahead && ed != nullptr ? ed + (b + 1) * bucket : nullptr);
      }
    });
  });
  return ffi::Error::Success();
}

// out = sum over k of decode(payload k), in rank order (the first decoding seeds it).
ffi::Error QsgdDecodeSum(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> words, ffi::Buffer<ffi::F32> scales,
                         int64_t levels, int64_t bucket, ffi::ResultBuffer<ffi::F32> out) {
  const int64_t n = out->element_count();
  const int64_t bits = CodeBits(levels);
  if (!ValidBucket(bucket) || (bits != 2 && bits != 4 && bits != 8 && bits != 16))
    return ffi::Error::InvalidArgument("qsgd_decode_sum: unsupported bucket or code width");
  const int64_t nb = (n + bucket - 1) / bucket;
  const int64_t nw = (n * bits + 31) / 32;
  const auto dims = words.dimensions();
  if (dims.size() != 2 || dims[1] != nw || scales.dimensions().size() != 2 ||
      scales.dimensions()[0] != dims[0] || scales.dimensions()[1] != nb || dims[0] < 1)
    return ffi::Error::InvalidArgument("qsgd_decode_sum: payload shapes do not match");
  const int64_t K = dims[0];
  // scale * fl(1/s), not scale / s: what every path computes (kernels/_common.level_step).
  const float inv_s = 1.0f / static_cast<float>(levels);
  const uint32_t* wd = words.typed_data();
  const float* sd = scales.typed_data();
  float* od = out->typed_data();
  DispatchBits(bits, [&](auto bits_tag) {
    constexpr int BITS = decltype(bits_tag)::value;
    constexpr int kPerWord = 32 / BITS;
    const LaneUnpacker<BITS> unpack;
    const VI mask = VI{} + ((1 << (BITS - 1)) - 1);
    ParallelBuckets(pool, nb, bucket, [&](int64_t first, int64_t end) {
      std::vector<float> acc(bucket);
      std::vector<uint32_t> wbuf(bucket / kPerWord + kLanes);
      for (int64_t b = first; b < end; ++b) {
        const int64_t start = b * bucket;
        const int64_t valid = std::min(bucket, n - start);
        const int64_t w0 = start / kPerWord;
        const int64_t wn = std::min<int64_t>(bucket / kPerWord, nw - w0);
        // Whole buckets are written straight to the output; the last one via `acc`.
        float* dst = valid == bucket ? od + start : acc.data();
        for (int64_t k = 0; k < K; ++k) {
          const VF step = SplatF(sd[k * nb + b] * inv_s);
          std::memcpy(wbuf.data(), wd + k * nw + w0, wn * sizeof(uint32_t));
          std::fill(wbuf.begin() + wn, wbuf.end(), 0u);
#pragma GCC unroll 2
          for (int64_t j = 0; j < bucket; j += kLanes) {
            const VI c = reinterpret_cast<VI>(unpack(wbuf.data(), j));
            const VF mag = __builtin_convertvector(c & mask, VF);
            const VF q = (c >> (BITS - 1)) != 0 ? -mag : mag;
            Store(dst + j, k == 0 ? q * step : MulAdd(q, step, LoadF(dst + j)));
          }
        }
        if (dst != od + start) std::memcpy(od + start, acc.data(), valid * sizeof(float));
      }
    });
  });
  return ffi::Error::Success();
}

// --------------------------------------------------------------------------- 1-bit SGD

// jaxcomp.kernels._common.sum_shift: c with 2^c >= 2 * count.
inline int SumShift(int64_t count) {
  int c = 0;
  while ((int64_t{1} << c) < count) ++c;
  return c + 1;
}

// jaxcomp.kernels._common.side_mean: total / count (0 when empty); where the float32 sum
// overflowed to +-inf although the values are finite, fl(scaled / count) * 2^shift
// clipped to +-FLT_MAX, from the sum of the values scaled by 2^-shift.
inline float SideMean(float total, float scaled, float count, float up) {
  if (!(count > 0.0f)) return 0.0f;
  const float safe = std::max(count, 1.0f);
  if (std::isinf(total) && std::isfinite(scaled)) {
    constexpr float kMax = std::numeric_limits<float>::max();
    return std::min(std::max(scaled / safe * up, -kMax), kMax);
  }
  return total / safe;
}

// Bit c of the result is [v[c] < 0] for 32 values (not set for -0.0 or a NaN).
inline uint32_t SignWord(const float* v) {
  uint32_t word = 0;
  const VF zero = SplatF(0.0f);
  for (int g = 0; g < 32 / kLanes; ++g) {
    const VI neg = LoadF(v + kLanes * g) < zero;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    static_assert(kLanes == 16);
    const uint32_t bits = _mm512_movepi32_mask(reinterpret_cast<__m512i>(neg));
#elif defined(__AVX__)
    static_assert(kLanes == 16);
    typedef float F8 __attribute__((vector_size(32)));
    const F8 lo = reinterpret_cast<const F8*>(&neg)[0], hi = reinterpret_cast<const F8*>(&neg)[1];
    const uint32_t bits = static_cast<uint32_t>(__builtin_ia32_movmskps256(lo)) |
                          static_cast<uint32_t>(__builtin_ia32_movmskps256(hi)) << 8;
#else
    uint32_t bits = 0;
    for (int l = 0; l < kLanes; ++l) bits |= static_cast<uint32_t>(neg[l] & 1) << l;
#endif
    word |= bits << (kLanes * g);
  }
  return word;
}

ffi::Error OneBitEncode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> residual,
                        int64_t bucket, ffi::ResultBuffer<ffi::U32> words,
                        ffi::ResultBuffer<ffi::F32> pos, ffi::ResultBuffer<ffi::F32> neg,
                        ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = x.element_count();
  if (!ValidBucket(bucket))
    return ffi::Error::InvalidArgument("bucket must be a power of two in 32..65536");
  const int64_t nb = (n + bucket - 1) / bucket;
  const int64_t nw = (n + 31) / 32;
  const bool has_e = residual.element_count() != 0;
  if (words->element_count() != nw || pos->element_count() != nb ||
      neg->element_count() != nb ||
      (has_e && (residual.element_count() != n || new_residual->element_count() != n)) ||
      (!has_e && new_residual->element_count() != 0))
    return ffi::Error::InvalidArgument("onebit_encode: buffer sizes do not match");
  const float* xd = x.typed_data();
  const float* ed = has_e ? residual.typed_data() : nullptr;
  uint32_t* wd = words->typed_data();
  float* pd = pos->typed_data();
  float* ngd = neg->typed_data();
  float* nd = has_e ? new_residual->typed_data() : nullptr;
  const int shift = SumShift(bucket);
  const float sum_down = std::ldexp(1.0f, -shift), sum_up = std::ldexp(1.0f, shift);
  ParallelBuckets(pool, nb, bucket, [&](int64_t first, int64_t end) {
    std::vector<float> scratch(bucket);
    for (int64_t b = first; b < end; ++b) {
      int64_t valid;
      const float* v = LoadBucket(xd, ed, n, bucket, b, scratch.data(), &valid);
      // Sums of each sign; a NaN lands in both (as jnp.maximum / jnp.minimum put it).
      const VF zero = SplatF(0.0f), one = SplatF(1.0f);
      VF ps = zero, ns = zero, cnt = zero;
      for (int64_t j = 0; j < bucket; j += kLanes) {
        const VF a = LoadF(v + j);
        ps += a < zero ? zero : a;
        ns += a > zero ? zero : a;
        cnt += a < zero ? one : zero;  // exact: at most 65536 per lane
      }
      const float neg_count = SumLanes(cnt);
      const float pos_count = static_cast<float>(valid) - neg_count;
      const float psum = SumLanes(ps), nsum = SumLanes(ns);
      float ps_scaled = 0.0f, ns_scaled = 0.0f;
      if (std::isinf(psum) || std::isinf(nsum)) {  // rare: sum again, scaled (SideMean)
        const VF down = SplatF(sum_down);
        VF ps2 = zero, ns2 = zero;
        for (int64_t j = 0; j < bucket; j += kLanes) {
          const VF a = LoadF(v + j) * down;
          ps2 += a < zero ? zero : a;
          ns2 += a > zero ? zero : a;
        }
        ps_scaled = SumLanes(ps2);
        ns_scaled = SumLanes(ns2);
      }
      const float pm = SideMean(psum, ps_scaled, pos_count, sum_up);
      const float nm = SideMean(nsum, ns_scaled, neg_count, sum_up);
      pd[b] = pm;
      ngd[b] = nm;
      const int64_t w0 = b * bucket / 32;
      const int64_t wn = std::min<int64_t>(bucket / 32, nw - w0);
      for (int64_t i = 0; i < wn; ++i) wd[w0 + i] = SignWord(v + 32 * i);
      if (nd != nullptr) {
        float* out = nd + b * bucket;
        for (int64_t j = 0; j < valid; ++j) out[j] = v[j] - (v[j] < 0.0f ? nm : pm);
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error OneBitDecodeSum(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> words, ffi::Buffer<ffi::F32> pos,
                           ffi::Buffer<ffi::F32> neg, int64_t bucket,
                           ffi::ResultBuffer<ffi::F32> out) {
  const int64_t n = out->element_count();
  if (!ValidBucket(bucket))
    return ffi::Error::InvalidArgument("bucket must be a power of two in 32..65536");
  const int64_t nb = (n + bucket - 1) / bucket;
  const int64_t nw = (n + 31) / 32;
  const auto dims = words.dimensions();
  if (dims.size() != 2 || dims[1] != nw || dims[0] < 1 || pos.dimensions().size() != 2 ||
      pos.dimensions()[0] != dims[0] || pos.dimensions()[1] != nb ||
      neg.element_count() != pos.element_count())
    return ffi::Error::InvalidArgument("onebit_decode_sum: payload shapes do not match");
  const int64_t K = dims[0];
  const uint32_t* wd = words.typed_data();
  const float* pd = pos.typed_data();
  const float* ngd = neg.typed_data();
  float* od = out->typed_data();
  const LaneUnpacker<1> unpack;
  ParallelBuckets(pool, nb, bucket, [&](int64_t first, int64_t end) {
    std::vector<float> acc(bucket);
    std::vector<uint32_t> wbuf(bucket / 32 + kLanes);
    for (int64_t b = first; b < end; ++b) {
      const int64_t start = b * bucket;
      const int64_t valid = std::min(bucket, n - start);
      const int64_t w0 = start / 32;
      const int64_t wn = std::min<int64_t>(bucket / 32, nw - w0);
      float* dst = valid == bucket ? od + start : acc.data();
      for (int64_t k = 0; k < K; ++k) {
        const VF pm = SplatF(pd[k * nb + b]), nm = SplatF(ngd[k * nb + b]);
        std::memcpy(wbuf.data(), wd + k * nw + w0, wn * sizeof(uint32_t));
        std::fill(wbuf.begin() + wn, wbuf.end(), 0u);
#pragma GCC unroll 2
        for (int64_t j = 0; j < bucket; j += kLanes) {
          const VF d = unpack(wbuf.data(), j) != 0u ? nm : pm;
          Store(dst + j, k == 0 ? d : LoadF(dst + j) + d);
        }
      }
      if (dst != od + start) std::memcpy(od + start, acc.data(), valid * sizeof(float));
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompQsgdEncode, QsgdEncode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Attr<int64_t>("levels")
                                  .Attr<int64_t>("bucket")
                                  .Attr<int64_t>("l2")
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompQsgdDecodeSum, QsgdDecodeSum,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("levels")
                                  .Attr<int64_t>("bucket")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompOneBitEncode, OneBitEncode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bucket")
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompOneBitDecodeSum, OneBitDecodeSum,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bucket")
                                  .Ret<ffi::Buffer<ffi::F32>>());

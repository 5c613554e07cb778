// Native CPU kernels of QSGD and 1-bit SGD, called from XLA as FFI custom calls.
//
// Built on first use by jaxcomp.kernels.cpu (the system C++ compiler, -O3 -march=native,
// -ffp-contract=off: no fused multiply-adds, so every float operation rounds as XLA's
// does). What each kernel writes is, bit for bit, the payload of the XLA path of
// jaxcomp.codecs.QSGD / OneBit (OneBit's means, and QSGD's l2 scales, up to the order of
// a sum inside a bucket): see jaxcomp/kernels/cpu.py and tests/test_cpu_kernels.py.
//
// Why: XLA:CPU runs each fusion as its own pass over memory and runs reductions with
// fused inputs several times slower than elementwise loops, so the XLA path reads a
// QSGD input about 5 times (scale, hash, quantize and pack, decode); these kernels
// take one bucket at a time while it sits in L1 (docs/benchmarks.md, "Native CPU
// kernels").
//
// Layouts (jaxcomp._src.bitpack's lanes layout): code k of word w holds value
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

// Wellons' lowbias32 on every lane (jaxcomp._src.rng.mix32).
inline VU Mix32(VU x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// max |v| over a bucket and whether all its values are finite.
inline float AbsMaxFinite(const float* v, int64_t bucket, bool* finite) {
  VF m = SplatF(0.0f);
  VI bad = VI{};
  for (int64_t j = 0; j < bucket; j += kLanes) {
    const VI bits = reinterpret_cast<VI>(LoadF(v + j)) & 0x7FFFFFFF;
    bad |= bits >= 0x7F800000;  // Inf or NaN
    const VF a = reinterpret_cast<VF>(bits);
    m = a > m ? a : m;
  }
  float amax = 0.0f;
  int32_t any_bad = 0;
  for (int l = 0; l < kLanes; ++l) {
    amax = m[l] > amax ? m[l] : amax;
    any_bad |= bad[l];
  }
  *finite = any_bad == 0;
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

// One bucket of BITS-bit codes: its scale, its words, and (when new_e) the new residual
// v - Q(v). Mirrors QSGD.quantize / encode / dequantize of jaxcomp/_src/codecs.py.
template <int BITS>
void QsgdBucket(const QsgdParams& p, int64_t b, const float* v, int64_t valid,
                uint32_t* words, float* scales, float* new_e, uint32_t* codes) {
  constexpr int kMbits = BITS - 1;
  constexpr int kPerWord = 32 / BITS;
  const int64_t bucket = p.bucket;
  const float s = static_cast<float>(p.levels);
  bool finite;
  const float amax = AbsMaxFinite(v, bucket, &finite);
  float scale = amax;
  if (p.l2) {  // amax * sqrt(sum((v / amax)^2)): no overflow or underflow of the squares
    const VF safe = SplatF(amax > 0.0f ? amax : 1.0f);
    VF acc = SplatF(0.0f);
    for (int64_t j = 0; j < bucket; j += kLanes) {
      const VF w = LoadF(v + j) / safe;
      acc += w * w;
    }
    scale = amax * std::sqrt(SumLanes(acc));
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
  // Whole vectors of words are written in place; the last bucket's short tail via
  // `codes` (which also serves PackLanes for 2-bit codes).
  uint32_t tail_words[kLanes * BITS / 32 > 0 ? kLanes * BITS / 32 : 1];
  const VF step = SplatF(scale * (1.0f / s));  // kernels/_common.level_step
  float* out_e = new_e != nullptr ? new_e + b * bucket : nullptr;
  if (scale > 0.0f) {
    const VU lane = Iota();
    const uint32_t base = static_cast<uint32_t>(b * bucket);
    const VF scale_v = SplatF(scale), s_v = SplatF(s), one = SplatF(1.0f), zero = SplatF(0.0f);
    const VU k0 = SplatU(p.k0), k1 = SplatU(p.k1);
#pragma GCC unroll 2
    for (int64_t j = 0; j < bucket; j += kLanes) {
      const VF a = LoadF(v + j);
      // |v| / scale * s, the division first (as XLA does it): the max maps to exactly s.
#ifndef JAXCOMP_ABLATE_DIVISION
      const VF r = reinterpret_cast<VF>(reinterpret_cast<VI>(a) & 0x7FFFFFFF) / scale_v * s_v;
#else  // benchmarks/cpu_kernel_loop.py only: what the division costs (wrong payloads)
      const VF r = reinterpret_cast<VF>(reinterpret_cast<VI>(a) & 0x7FFFFFFF) * s_v;
#endif
      // floor(r) for 0 <= r <= s < 2**31: truncation toward zero is exact.
      const VF low = __builtin_convertvector(__builtin_convertvector(r, VI), VF);
      // The counter hash of the flat index; u24 < 2**24 converts to float exactly.
      const VU idx = SplatU(base + static_cast<uint32_t>(j)) + lane;
#ifndef JAXCOMP_ABLATE_HASH
      const VI u24 = reinterpret_cast<VI>(Mix32(Mix32(idx ^ k0) ^ k1) >> 8);
#else  // benchmarks/cpu_kernel_loop.py only: what the hash costs (wrong payloads)
      const VI u24 = reinterpret_cast<VI>((idx ^ k0) >> 8);
#endif
      const VF up = __builtin_convertvector(u24, VF) < (r - low) * 16777216.0f ? one : zero;
      VF magf = low + up;
      magf = magf < s_v ? magf : s_v;
      const VI mag = __builtin_convertvector(magf, VI);
      const VI neg = (a < zero) & (mag > 0);  // a zero code carries no sign
      const VU code = reinterpret_cast<VU>(mag | (neg & (1 << kMbits)));
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
        if (w + static_cast<int64_t>(sizeof(VH) / 4) <= bucket_words) {
          std::memcpy(out_words + w, &packed, sizeof(VH));
        } else if (w < bucket_words) {
          std::memcpy(tail_words, &packed, sizeof(VH));
          std::memcpy(out_words + w, tail_words, (bucket_words - w) * sizeof(uint32_t));
        }
      } else {
        Store(codes + j, code);
      }
      if (out_e != nullptr) {
        const VF e = a - (neg != 0 ? -magf : magf) * step;
        if (j + kLanes <= valid) {
          Store(out_e + j, e);
        } else if (j < valid) {
          float tail[kLanes];
          Store(tail, e);
          std::memcpy(out_e + j, tail, (valid - j) * sizeof(float));
        }
      }
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
        QsgdBucket<BITS>(p, b, v, valid, wd, sd, nd, codes.data());
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
      const float pm = pos_count > 0.0f ? psum / std::max(pos_count, 1.0f) : 0.0f;
      const float nm = neg_count > 0.0f ? nsum / std::max(neg_count, 1.0f) : 0.0f;
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

// AVX2/FMA fallback for CPUs without AVX512-BF16. Reads the same packed layout: a 32-bit lane holds
// one row's column pair (lo = even column, hi = odd column), so `lane << 16` and `lane & 0xffff0000`
// are exactly the two fp32 weights, with no conversion table.
#include <immintrin.h>

#include "fk.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace fk {
namespace {

constexpr int kMr = 2;  // 2 tokens x 32 rows = 8 ymm accumulators (of 16 registers)

// acc[M][32] (+)= W[kp][32][2] . x[M][2kp..]: a 128-byte kp row is 4 registers of 8 rows' pairs.
// Hint/dist: the weight stream's software prefetch (StreamHint, chosen at run time in fk_tuning.cpp).
template <int M, int Hint>
void mk(const uint16_t* w, int64_t kpairs, const uint16_t* x, int64_t ldx, float* acc,
        bool accumulate, int64_t dist, int64_t far) {
  __m256 c[M][4];
  for (int t = 0; t < M; ++t)
    for (int j = 0; j < 4; ++j)
      c[t][j] = accumulate ? _mm256_loadu_ps(acc + t * kBlockN + 8 * j) : _mm256_setzero_ps();
  const __m256i hi_mask = _mm256_set1_epi32(int(0xffff0000u));
  const char* wp = reinterpret_cast<const char*>(w);
  for (int64_t kp = 0; kp < kpairs; ++kp, wp += 128) {
    prefetch_stream_step<Hint>(wp, dist, far);
    __m256 xe[M], xo[M];
    for (int t = 0; t < M; ++t) {
      int pair;
      __builtin_memcpy(&pair, x + t * ldx + 2 * kp, 4);
      const __m256i p = _mm256_set1_epi32(pair);
      xe[t] = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
      xo[t] = _mm256_castsi256_ps(_mm256_and_si256(p, hi_mask));
    }
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + 32 * j));
      const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 o = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
      for (int t = 0; t < M; ++t) c[t][j] = _mm256_fmadd_ps(o, xo[t], _mm256_fmadd_ps(e, xe[t], c[t][j]));
    }
  }
  for (int t = 0; t < M; ++t)
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(acc + t * kBlockN + 8 * j, c[t][j]);
}

template <int Hint>
void mk_hint(const uint16_t* w, int64_t kpairs, const uint16_t* x, int64_t ldx, int m, float* acc,
             bool accumulate, int64_t dist, int64_t far) {
  if (m == 1) mk<1, Hint>(w, kpairs, x, ldx, acc, accumulate, dist, far);
  else mk<2, Hint>(w, kpairs, x, ldx, acc, accumulate, dist, far);
}

// Several token groups reuse a chunk from L2 (pf_lines > 0): no stream prefetch then.
void mk_avx2(const uint16_t* w, int64_t kpairs, const uint16_t* x, int64_t ldx, int m,
             float* acc, bool accumulate, const char*, int64_t pf_lines) {
  const StreamTuning st = stream_tuning();
  const bool streaming = pf_lines <= 0;
  const int hint = streaming ? st.hint : int(kHintNone);
  const int64_t far = streaming ? st.far : 0;
  switch (hint) {
    case kHintT0: return mk_hint<kHintT0>(w, kpairs, x, ldx, m, acc, accumulate, st.distance, far);
    case kHintT1: return mk_hint<kHintT1>(w, kpairs, x, ldx, m, acc, accumulate, st.distance, far);
    case kHintNta: return mk_hint<kHintNta>(w, kpairs, x, ldx, m, acc, accumulate, st.distance, far);
    default: return mk_hint<kHintNone>(w, kpairs, x, ldx, m, acc, accumulate, st.distance, far);
  }
}

}  // namespace

static inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n through the exponent field; n is in [-126, 127] after the clamp
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// fp32 -> bf16, round to nearest even; NaN stays NaN (quiet bit set)
static inline __m128i to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
  // pack the low 16 bits of 8 lanes (values < 65536, so unsigned saturation is exact)
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

void silu_mul_avx2(const float* a, const float* b, int64_t n, uint16_t* h) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 va = _mm256_loadu_ps(a + i), vb = _mm256_loadu_ps(b + i);
    const __m256 s = _mm256_div_ps(va, _mm256_add_ps(_mm256_set1_ps(1.0f),
                                                     exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), va))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i), to_bf16(_mm256_mul_ps(s, vb)));
  }
  silu_mul_generic(a + i, b + i, n - i, h + i);
}

void store_avx2(const float* acc, const float* bias, int64_t n, void* y, bool out_f32) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(acc + i);
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + i));
    if (out_f32) _mm256_storeu_ps(static_cast<float*>(y) + i, v);
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(y) + i), to_bf16(v));
  }
  if (i < n) {
    void* rest = out_f32 ? static_cast<void*>(static_cast<float*>(y) + i)
                         : static_cast<void*>(static_cast<uint16_t*>(y) + i);
    store_generic(acc + i, bias ? bias + i : nullptr, n - i, rest, out_f32);
  }
}

namespace {

template <int Hint>
uint64_t read256(const char* q, int64_t n, int64_t dist) {
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
  for (int64_t i = 0; i < n; i += 128) {
    if constexpr (Hint != kHintNone) {
      prefetch<Hint>(q + i + dist);
      prefetch<Hint>(q + i + dist + 64);
    }
    s0 = _mm256_xor_si256(s0, _mm256_load_si256(reinterpret_cast<const __m256i*>(q + i)));
    s1 = _mm256_xor_si256(s1, _mm256_load_si256(reinterpret_cast<const __m256i*>(q + i + 32)));
    s2 = _mm256_xor_si256(s2, _mm256_load_si256(reinterpret_cast<const __m256i*>(q + i + 64)));
    s3 = _mm256_xor_si256(s3, _mm256_load_si256(reinterpret_cast<const __m256i*>(q + i + 96)));
  }
  const __m256i s = _mm256_xor_si256(_mm256_xor_si256(s0, s1), _mm256_xor_si256(s2, s3));
  return uint64_t(_mm256_extract_epi64(s, 0) ^ _mm256_extract_epi64(s, 3));
}

uint64_t read_avx2(const void* p, int64_t n, int hint, int64_t dist) {
  const char* q = static_cast<const char*>(p);
  switch (hint) {
    case kHintT0: return read256<kHintT0>(q, n, dist);
    case kHintT1: return read256<kHintT1>(q, n, dist);
    case kHintNta: return read256<kHintNta>(q, n, dist);
    default: return read256<kHintNone>(q, n, dist);
  }
}

}  // namespace

extern const IsaOps kAvx2Ops = {"avx2", kMr, mk_avx2, silu_mul_avx2, store_avx2, read_avx2, nullptr};

}  // namespace fk

#pragma GCC pop_options
#endif  // __x86_64__

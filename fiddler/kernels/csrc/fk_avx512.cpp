// AVX512-BF16 path (vdpbf16ps). Everything below the target pragma is compiled for that ISA only
// and is only called after the runtime check in fk_api.cpp; standard headers are included first
// so no shared inline function is emitted with AVX-512 instructions.
#include <immintrin.h>

#include "fk.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace fk {
namespace {

constexpr int kMr = 12;          // 12 tokens x 32 rows = 24 zmm accumulators + 2 weight registers

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// acc[M][32] (+)= W[kp][32][2] . x[M][2kp..2kp+1]: each 128-byte kp row of the block is loaded
// once into 2 registers and multiplied with every token's broadcast column pair.
// Hint: the software prefetch of the weight stream when this call streams from DRAM (StreamHint;
// chosen per CPU at run time, see fk_tuning.cpp), `dist` bytes ahead, and into L2 `far` bytes ahead.
template <int M, int Hint>
void mk(const uint16_t* w, int64_t kpairs, const uint16_t* x, int64_t ldx, float* acc,
        bool accumulate, const char* pf, int64_t pf_lines, int64_t dist, int64_t far) {
  __m512 c[M][2];
  for (int t = 0; t < M; ++t)
    for (int j = 0; j < 2; ++j)
      c[t][j] = accumulate ? _mm512_loadu_ps(acc + t * kBlockN + 16 * j) : _mm512_setzero_ps();
  const int* xr[M];
  for (int t = 0; t < M; ++t) xr[t] = reinterpret_cast<const int*>(x + t * ldx);
  const char* wp = reinterpret_cast<const char*>(w);
  const bool streaming = pf_lines <= 0;
  const int64_t per = (pf_lines + kpairs - 1) / kpairs;
  for (int64_t kp = 0; kp < kpairs; ++kp, wp += 128) {
    prefetch_kernel_step<Hint>(wp, streaming, dist, far, pf, pf_lines, per);
    const __m512bh w0 = as_bh(_mm512_load_si512(wp)), w1 = as_bh(_mm512_load_si512(wp + 64));
    for (int t = 0; t < M; ++t) {
      const __m512bh b = as_bh(_mm512_set1_epi32(xr[t][kp]));
      c[t][0] = _mm512_dpbf16_ps(c[t][0], w0, b);
      c[t][1] = _mm512_dpbf16_ps(c[t][1], w1, b);
    }
  }
  for (int t = 0; t < M; ++t)
    for (int j = 0; j < 2; ++j) _mm512_storeu_ps(acc + t * kBlockN + 16 * j, c[t][j]);
}

using MkFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, bool, const char*,
                      int64_t, int64_t, int64_t);
template <int Hint>
constexpr MkFn kMkRow[kMr] = {mk<1, Hint>, mk<2, Hint>, mk<3, Hint>, mk<4, Hint>,
                              mk<5, Hint>, mk<6, Hint>, mk<7, Hint>, mk<8, Hint>,
                              mk<9, Hint>, mk<10, Hint>, mk<11, Hint>, mk<12, Hint>};
constexpr const MkFn* kMk[kNumHints] = {kMkRow<kHintNone>, kMkRow<kHintT0>, kMkRow<kHintT1>,
                                        kMkRow<kHintNta>};

void mk_avx512(const uint16_t* w, int64_t kpairs, const uint16_t* x, int64_t ldx, int m,
               float* acc, bool accumulate, const char* pf, int64_t pf_lines) {
  const StreamTuning st = stream_tuning();
  kMk[st.hint][m - 1](w, kpairs, x, ldx, acc, accumulate, pf, pf_lines, st.distance, st.far);
}

constexpr int kMr2 = 6;  // 6 tokens x (32 + 32) rows = 24 accumulators + 4 weight registers

// mk on two blocks at once (IsaOps::mk2): each token's broadcast column pair feeds 4 vdpbf16ps (64 rows)
// instead of 2, so a kp step issues 6 broadcasts and 4 loads per 24 dot products where mk issues 12 and
// 2. On AMD Zen 4 (family 25 model 17) a 512-bit broadcast takes issue slots of the double-pumped
// dot-product pipes: mk reached ~0.75 of the vdpbf16ps peak on L1-resident blocks, this ~0.86.
// Used where the blocks are reused from cache by many token groups (the many-token blocking), whose
// previous calls pulled them in: pf_lines lines of each of pfa and pfb (the next pieces) are prefetched
// into L2 along the way, none when 0 (T1 rather than T0: one expert thread at 16 tokens 1.08-1.14x).
template <int M>
void mk2(const uint16_t* wa, const uint16_t* wb, int64_t kpairs, const uint16_t* x, int64_t ldx, float* acc_a,
         float* acc_b, bool accumulate, const char* pfa, const char* pfb, int64_t pf_lines) {
  __m512 c[M][4];
  for (int t = 0; t < M; ++t)
    for (int j = 0; j < 2; ++j) {
      c[t][j] = accumulate ? _mm512_loadu_ps(acc_a + t * kBlockN + 16 * j) : _mm512_setzero_ps();
      c[t][2 + j] = accumulate ? _mm512_loadu_ps(acc_b + t * kBlockN + 16 * j) : _mm512_setzero_ps();
    }
  const int* xr[M];
  for (int t = 0; t < M; ++t) xr[t] = reinterpret_cast<const int*>(x + t * ldx);
  const char* pa = reinterpret_cast<const char*>(wa);
  const char* pb = reinterpret_cast<const char*>(wb);
  const int64_t per = pf_lines > 0 ? (pf_lines + kpairs - 1) / kpairs : 0;
  for (int64_t kp = 0; kp < kpairs; ++kp, pa += 128, pb += 128) {
    if (pf_lines > 0) {
      for (int64_t i = 0; i < per; ++i) {  // into L2 (T1), where the pieces are read from: T0 would evict
        if (pfa) _mm_prefetch(pfa + 64 * i, _MM_HINT_T1);  // this call's rows and pieces from L1
        if (pfb) _mm_prefetch(pfb + 64 * i, _MM_HINT_T1);
      }
      if (pfa) pfa += 64 * per;
      if (pfb) pfb += 64 * per;
      pf_lines -= per;
    }
    const __m512bh w0 = as_bh(_mm512_load_si512(pa)), w1 = as_bh(_mm512_load_si512(pa + 64));
    const __m512bh w2 = as_bh(_mm512_load_si512(pb)), w3 = as_bh(_mm512_load_si512(pb + 64));
    for (int t = 0; t < M; ++t) {
      const __m512bh b = as_bh(_mm512_set1_epi32(xr[t][kp]));
      c[t][0] = _mm512_dpbf16_ps(c[t][0], w0, b);
      c[t][1] = _mm512_dpbf16_ps(c[t][1], w1, b);
      c[t][2] = _mm512_dpbf16_ps(c[t][2], w2, b);
      c[t][3] = _mm512_dpbf16_ps(c[t][3], w3, b);
    }
  }
  for (int t = 0; t < M; ++t)
    for (int j = 0; j < 2; ++j) {
      _mm512_storeu_ps(acc_a + t * kBlockN + 16 * j, c[t][j]);
      _mm512_storeu_ps(acc_b + t * kBlockN + 16 * j, c[t][2 + j]);
    }
}

using Mk2Fn = void (*)(const uint16_t*, const uint16_t*, int64_t, const uint16_t*, int64_t, float*, float*, bool,
                       const char*, const char*, int64_t);
constexpr Mk2Fn kMk2[kMr2] = {mk2<1>, mk2<2>, mk2<3>, mk2<4>, mk2<5>, mk2<6>};

void mk2_avx512(const uint16_t* wa, const uint16_t* wb, int64_t kpairs, const uint16_t* x, int64_t ldx, int m,
                float* acc_a, float* acc_b, bool accumulate, const char* pfa, const char* pfb, int64_t pf_lines) {
  kMk2[m - 1](wa, wb, kpairs, x, ldx, acc_a, acc_b, accumulate, pfa, pfb, pf_lines);
}

}  // namespace

// exp on [-87.3, 88.7] by range reduction to |r| <= ln2/2 and a degree-7 polynomial
// (relative error ~1e-7, far below bf16 rounding).
static inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

void silu_mul_avx512_bf16(const float* a, const float* b, int64_t n, uint16_t* h) {
  int64_t i = 0;
  for (; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    const __m512 va = _mm512_maskz_loadu_ps(k, a + i), vb = _mm512_maskz_loadu_ps(k, b + i);
    const __m512 s = _mm512_div_ps(va, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                     exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), va))));
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_mul_ps(s, vb));
    _mm256_mask_storeu_epi16(h + i, k, (__m256i)v);
  }
}

void silu_mul_f32_avx512(const float* a, const float* b, int64_t n, float* h) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    const __m512 va = _mm512_maskz_loadu_ps(k, a + i), vb = _mm512_maskz_loadu_ps(k, b + i);
    const __m512 s = _mm512_div_ps(va, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                     exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), va))));
    _mm512_mask_storeu_ps(h + i, k, _mm512_mul_ps(s, vb));
  }
}

void store_avx512_bf16(const float* acc, const float* bias, int64_t n, void* y, bool out_f32) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(k, acc + i);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, bias + i));
    if (out_f32) _mm512_mask_storeu_ps(static_cast<float*>(y) + i, k, v);
    else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + i, k, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

extern const IsaOps kAvx512Ops = {"avx512_bf16", kMr, mk_avx512, silu_mul_avx512_bf16, store_avx512_bf16,
                                  read_avx512, nullptr, kMr2, mk2_avx512};

}  // namespace fk

#pragma GCC pop_options
#endif  // __x86_64__

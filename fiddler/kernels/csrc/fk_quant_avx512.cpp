// Quantized micro-kernels for AVX-512 (F, BW, VL, VNNI; F16C for the scales). One zmm lane per row
// of a 16-row group (layout: fk_quant.h). Compiled for that ISA only, called after the run-time check.
#include <immintrin.h>

#include <algorithm>

#include "fk_quant.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")

namespace fk {
namespace {

// Up to 16 tokens a call, so that 16 tokens stream a row group from DRAM once (two calls of 8 had the
// second re-read it from L2 with the stream idle meanwhile). Each block's tokens go in balanced passes of
// at most qpass() tokens (8 or 16, the per-vendor table of fk_tuning.cpp); a pass after the first re-reads the block's
// weights from L1. With passes of 8, a pass's 8 integer sums and the 16 fp32 sums about fill the 32 zmm
// (GCC 12 keeps 14 of the fp32 sums there); one pass of 16 keeps the fp32 sums past 8 in memory, a load
// and a store per block and token, and halves the weight loads and the broadcasts of the second pass.
// Which wins is the CPU's: on an AMD EPYC Zen 4 one pass took 1.15-1.25x the time per block at 16 tokens
// in L2; on an Intel Xeon (family 6 model 207) 0.90-0.93x in L2 and 0.93-0.96x streamed from DRAM (one core).
constexpr int kMr = 16;
// Up to this many tokens a pass, each token sums a block into two accumulators (see a8_block): Q4_0
// only, whose blocks arrive twice as fast from DRAM as Q8_0's.
constexpr int kSplitSumTokens[kNumQFormats] = {0, 2};

inline __m512i bcast4(const void* p) {
  int v;
  __builtin_memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The stream prefetch of the 64-byte line at p, issued next to its load (spread over the stream, not in
// bursts): `near` bytes ahead into L1 and, with a far distance (the per-CPU knob's second prefetch),
// `far` bytes ahead into L2; 0 = none. `dist` packs near (low 32 bits) and far (high 32 bits).
template <bool Pf>
inline void pf_line(const uint8_t* p, int64_t dist) {
  if constexpr (Pf) {
    const int64_t near = dist & 0xffffffff, far = dist >> 32;
    if (near) _mm_prefetch(reinterpret_cast<const char*>(p + near), _MM_HINT_T0);
    if (far) _mm_prefetch(reinterpret_cast<const char*>(p + far), _MM_HINT_T1);
  }
}
inline int64_t pf_distances(const StreamTuning& st) {
  return (st.hint != kHintNone ? st.distance : 0) | (st.far << 32);
}

// a8: per block, isum[t] = c[t] + sum_j dpbusd(u8 weights, s8 activations); the unsigned weights are
// Q8_0 q + 128 (stored so) or the Q4_0 nibbles, and c[t] (the a8 layout's s: minus the zero point times
// the sum of the activation quants, fk_quant.h) starts the sum, so isum is the signed dot product with no
// correction step. Per block and token the vector units then do one convert, one multiply of the two
// scales and one fma, the least the fixed numerics allow (AMD EPYC Zen 4, in registers: 8 vpdpbusd take
// 2.18 ns, with that epilogue 2.75 ns per block and token; this kernel at 16 tokens in L2: 2.78).
// With few tokens a single accumulator per token would chain 8 dependent vpdpbusd per block (~40
// cycles: slower than DRAM delivers a Q4_0 block on one core), so each token sums into NA
// independent accumulators that are added at the end of the block. Every token's fp32 sum takes the
// same operations in the same order whatever the pass and call it is in, so a token's bits do not
// depend on its neighbours.

// One block's products for the MH tokens of xb (token t's 32 quants at xb + 32 t), into f[0..MH). (Not
// always_inline: GCC 12 then drops the stream prefetches of pf_line, which cost 1.3x at 4-16 tokens.)
template <int Fmt, int MH, bool Pf>
inline void a8_block(const uint8_t* q, __m512 dw, const int8_t* xb, const float* db, const int32_t* cb, __m512* f,
                     int64_t dist) {
  constexpr int NA = MH <= kSplitSumTokens[Fmt] ? 2 : 1;
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512i is[MH][NA];
  for (int t = 0; t < MH; ++t) {
    is[t][0] = _mm512_set1_epi32(cb[t]);
    for (int a = 1; a < NA; ++a) is[t][a] = _mm512_setzero_si512();
  }
  if constexpr (Fmt == kQ8_0) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      pf_line<Pf>(q + 64 * j, dist);
      const __m512i wv = _mm512_load_si512(q + 64 * j);
      for (int t = 0; t < MH; ++t)
        is[t][j % NA] = _mm512_dpbusd_epi32(is[t][j % NA], wv, bcast4(xb + t * kQK + 4 * j));
    }
  } else {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      pf_line<Pf>(q + 64 * j, dist);
      const __m512i v = _mm512_load_si512(q + 64 * j);
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int t = 0; t < MH; ++t) {
        const int8_t* xt = xb + t * kQK;
        is[t][(2 * j) % NA] = _mm512_dpbusd_epi32(is[t][(2 * j) % NA], lo, bcast4(xt + 4 * j));
        is[t][(2 * j + 1) % NA] = _mm512_dpbusd_epi32(is[t][(2 * j + 1) % NA], hi, bcast4(xt + 16 + 4 * j));
      }
    }
  }
  for (int t = 0; t < MH; ++t) {
    __m512i sum = is[t][0];
    for (int a = 1; a < NA; ++a) sum = _mm512_add_epi32(sum, is[t][a]);
    f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(db[t])), f[t]);
  }
}

// The passes of one block over tokens S.. of M: balanced, of at most Pass tokens each (12 tokens in passes
// of 8: 6 and 6). Only the first streams (prefetches); the others find the block in L1.
template <int Fmt, int M, int Pass, int S, bool Pf>
inline void a8_passes(const uint8_t* q, __m512 dw, const int8_t* xb, const float* db, const int32_t* cb, __m512* f,
                      int64_t dist) {
  constexpr int passes = (M - S + Pass - 1) / Pass;
  constexpr int P = (M - S + passes - 1) / passes;
  a8_block<Fmt, P, Pf>(q, dw, xb + S * kQK, db + S, cb + S, f + S, dist);
  if constexpr (S + P < M) a8_passes<Fmt, M, Pass, S + P, false>(q, dw, xb, db, cb, f, 0);
}

template <int Fmt, int M, int Pass, bool Pf>
void mk_a8_t(const uint8_t* w, int64_t units, const int8_t* xq, const float* xd, const int32_t* xs, int64_t ld,
             float* acc, int64_t dist) {
  constexpr int64_t ub = Fmt == kQ8_0 ? 1088 : 576, qb = Fmt == kQ8_0 ? 512 : 256;
  __m512 f[M];
  for (int t = 0; t < M; ++t) f[t] = _mm512_setzero_ps();
  for (int64_t u = 0; u < units; ++u, w += ub) {
    pf_line<Pf>(w, dist);
    for (int b = 0; b < 2; ++b) {
      const int64_t kb = 2 * u + b;
      const __m512 dw = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(w + 32 * b)));
      a8_passes<Fmt, M, Pass, 0, Pf>(w + 64 + b * qb, dw, xq + kb * ld * kQK, xd + kb * ld, xs + kb * ld, f, dist);
    }
  }
  for (int t = 0; t < M; ++t) _mm512_storeu_ps(acc + t * kQRows, f[t]);
}

// w: weights dequantized in registers to fp32 (the integer q, times d_w once per block).
template <int Fmt, int M, bool Pf>
void mk_w_t(const uint8_t* w, int64_t units, const float* x, int64_t kp, float* acc, int64_t dist) {
  constexpr int64_t ub = Fmt == kQ8_0 ? 1088 : 576, qb = Fmt == kQ8_0 ? 512 : 256;
  __m512 f[M];
  for (int t = 0; t < M; ++t) f[t] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi32(0x0f), eight = _mm512_set1_epi32(8);
  for (int64_t u = 0; u < units; ++u, w += ub) {
    pf_line<Pf>(w, dist);
    for (int b = 0; b < 2; ++b) {
      const int64_t k0 = (2 * u + b) * kQK;
      const __m512 dw = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(w + 32 * b)));
      const uint8_t* q = w + 64 + b * qb;
      __m512 s[M];
      for (int t = 0; t < M; ++t) s[t] = _mm512_setzero_ps();
      if constexpr (Fmt == kQ8_0) {
        for (int j = 0; j < 8; ++j) {
          pf_line<Pf>(q + 64 * j, dist);
          const __m512i v = _mm512_xor_si512(_mm512_load_si512(q + 64 * j), _mm512_set1_epi8(char(0x80)));  // signed q
          __m512 c[4];
          c[0] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24));
          c[1] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24));
          c[2] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 8), 24));
          c[3] = _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24));
          for (int t = 0; t < M; ++t) {
            const float* xb = x + t * kp + k0 + 4 * j;
            for (int i = 0; i < 4; ++i) s[t] = _mm512_fmadd_ps(c[i], _mm512_set1_ps(xb[i]), s[t]);
          }
        }
      } else {
        for (int j = 0; j < 4; ++j) {
          pf_line<Pf>(q + 64 * j, dist);
          const __m512i v = _mm512_load_si512(q + 64 * j);
          for (int i = 0; i < 4; ++i) {
            const __m512 lo = _mm512_cvtepi32_ps(
                _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(v, 8 * i), low), eight));
            const __m512 hi = _mm512_cvtepi32_ps(
                _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(v, 8 * i + 4), low), eight));
            for (int t = 0; t < M; ++t) {
              const float* xb = x + t * kp + k0;
              s[t] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xb[4 * j + i]), s[t]);
              s[t] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xb[16 + 4 * j + i]), s[t]);
            }
          }
        }
      }
      for (int t = 0; t < M; ++t) f[t] = _mm512_fmadd_ps(s[t], dw, f[t]);
    }
  }
  for (int t = 0; t < M; ++t) _mm512_storeu_ps(acc + t * kQRows, f[t]);
}

// Dispatch on (format, token count, whether to prefetch the stream: only a single token group streams
// from DRAM; later groups find the row group in L2). The prefetch distance is the kernel's per-CPU
// stream knob (fk_tuning.cpp).
template <int Fmt, int M, int Pass>
void a8_m(const uint8_t* w, int64_t units, const int8_t* xq, const float* xd, const int32_t* xs, int64_t ld,
          float* acc) {
  const StreamTuning st = stream_tuning();
  if (st.hint != kHintNone || st.far) mk_a8_t<Fmt, M, Pass, true>(w, units, xq, xd, xs, ld, acc, pf_distances(st));
  else mk_a8_t<Fmt, M, Pass, false>(w, units, xq, xd, xs, ld, acc, 0);
}
template <int Fmt, int M>
void w_m(const uint8_t* w, int64_t units, const float* x, int64_t kp, float* acc) {
  const StreamTuning st = stream_tuning();
  if (st.hint != kHintNone || st.far) mk_w_t<Fmt, M, true>(w, units, x, kp, acc, pf_distances(st));
  else mk_w_t<Fmt, M, false>(w, units, x, kp, acc, 0);
}

using A8Fn = void (*)(const uint8_t*, int64_t, const int8_t*, const float*, const int32_t*, int64_t, float*);
using WFn = void (*)(const uint8_t*, int64_t, const float*, int64_t, float*);
// Up to 8 tokens a call the two pass settings are the same kernel.
template <int Fmt, int Pass>
constexpr A8Fn kA8[kMr] = {a8_m<Fmt, 1, 8>,     a8_m<Fmt, 2, 8>,     a8_m<Fmt, 3, 8>,     a8_m<Fmt, 4, 8>,
                           a8_m<Fmt, 5, 8>,     a8_m<Fmt, 6, 8>,     a8_m<Fmt, 7, 8>,     a8_m<Fmt, 8, 8>,
                           a8_m<Fmt, 9, Pass>,  a8_m<Fmt, 10, Pass>, a8_m<Fmt, 11, Pass>, a8_m<Fmt, 12, Pass>,
                           a8_m<Fmt, 13, Pass>, a8_m<Fmt, 14, Pass>, a8_m<Fmt, 15, Pass>, a8_m<Fmt, 16, Pass>};
template <int Fmt>
constexpr WFn kW[4] = {w_m<Fmt, 1>, w_m<Fmt, 2>, w_m<Fmt, 3>, w_m<Fmt, 4>};

void mk_a8(int fmt, const uint8_t* w, int64_t units, const int8_t* xq, const float* xd, const int32_t* xs,
           int64_t ld, int m, float* acc) {
  const bool one = qpass() == 16;
  (fmt == kQ8_0 ? (one ? kA8<kQ8_0, 16> : kA8<kQ8_0, 8>) : (one ? kA8<kQ4_0, 16> : kA8<kQ4_0, 8>))[m - 1](
      w, units, xq, xd, xs, ld, acc);
}
// w mode: at most 4 tokens per pass (4 accumulators + 4 block sums + dequantized columns); the
// driver's token groups use mr = 16, so split.
void mk_w(int fmt, const uint8_t* w, int64_t units, const float* x, int64_t kp, int m, float* acc) {
  for (int t0 = 0; t0 < m; t0 += 4) {
    const int mm = std::min(4, m - t0);
    (fmt == kQ8_0 ? kW<kQ8_0> : kW<kQ4_0>)[mm - 1](w, units, x + t0 * kp, kp, acc + t0 * kQRows);
  }
}

// One bf16 or fp32 row to Q8_0 activations, 32 values (two zmm of fp32) per block; the same
// arithmetic as quant_row_generic (exact max, IEEE 127 / amax, x * id rounded half to even), so the
// same bits.
inline void load32(const uint16_t* x, int64_t n, __m512& v0, __m512& v1) {
  const __mmask32 m = n >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << n) - 1);
  const __m512i raw = _mm512_maskz_loadu_epi16(m, x);  // 32 bf16, zero past n
  v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
  v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
}
inline void load32(const float* x, int64_t n, __m512& v0, __m512& v1) {
  const __mmask16 m0 = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
  const __mmask16 m1 = n >= 32 ? __mmask16(0xffff) : (n > 16 ? __mmask16((1u << (n - 16)) - 1) : __mmask16(0));
  v0 = _mm512_maskz_loadu_ps(m0, x);
  v1 = _mm512_maskz_loadu_ps(m1, x + 16);
}

template <class T>
void quant_row_t(const T* x, int64_t k, int64_t kp, int8_t* q, float* d, int32_t* s) {
  for (int64_t kb = 0; kb < kp / kQK; ++kb) {
    const int64_t c0 = kb * kQK;
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(kQK, k - c0));
    __m512 v0, v1;
    load32(x + c0, n, v0, v1);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    d[kb] = half_to_f32(f32_to_half(amax / 127.0f));
    const __m512 vid = _mm512_set1_ps(id);
    const __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + c0), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + c0 + 16), _mm512_cvtepi32_epi8(q1));
    s[kb] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}
void quant_row(const uint16_t* x, int64_t k, int64_t kp, int8_t* q, float* d, int32_t* s) {
  quant_row_t(x, k, kp, q, d, s);
}
void quant_row_f32(const float* x, int64_t k, int64_t kp, int8_t* q, float* d, int32_t* s) {
  quant_row_t(x, k, kp, q, d, s);
}

}  // namespace

// silu(a) * b in fp32: the AVX512 path's exp (fk_avx512.cpp) where the CPU has AVX512F+DQ (every
// avx512_bf16 CPU), else the portable one
void silu_mul_f32(const float* a, const float* b, int64_t n, float* h) {
  static const bool avx512 = __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512f");
  if (avx512) silu_mul_f32_avx512(a, b, n, h);
  else silu_mul_f32_generic(a, b, n, h);
}

extern const QuantOps kQuantAvx512Ops = {"avx512_vnni", kMr, mk_a8, mk_w, quant_row, quant_row_f32, silu_mul_f32};

}  // namespace fk

#pragma GCC pop_options
#endif  // __x86_64__

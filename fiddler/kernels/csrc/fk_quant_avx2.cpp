// Quantized micro-kernels for AVX2 (+FMA, F16C): the same packed layout as the AVX-512 path, each
// 64-byte column of a 16-row group read as two ymm halves (rows 0..7 and 8..15). The int8 dot
// product is pmaddubsw + pmaddwd (no VNNI on Haswell-class CPUs): Q8_0 uses |w| and sign(x, w) so
// that the unsigned operand stays within 0..128 (no saturation of the 16-bit pair sums).
#include <immintrin.h>

#include <algorithm>

#include "fk_quant.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace fk {
namespace {

constexpr int kMr = 2;

inline __m256i bcast4(const void* p) {
  int v;
  __builtin_memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The stream prefetch of the 64-byte line at p, next to its first load: `near` bytes ahead into L1 and
// `far` bytes ahead into L2 (the per-CPU knob's two distances; 0 = none), packed as near | far << 32.
inline void pf_line(const uint8_t* p, int64_t dist) {
  const int64_t near = dist & 0xffffffff, far = dist >> 32;
  if (near) _mm_prefetch(reinterpret_cast<const char*>(p + near), _MM_HINT_T0);
  if (far) _mm_prefetch(reinterpret_cast<const char*>(p + far), _MM_HINT_T1);
}

inline __m256 scales8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int Fmt, int M>
void mk_a8_t(const uint8_t* w, int64_t units, const int8_t* xq, const float* xd, const int32_t* xs, int64_t ld,
             float* acc, int64_t dist) {
  constexpr int64_t ub = Fmt == kQ8_0 ? 1088 : 576, qb = Fmt == kQ8_0 ? 512 : 256;
  __m256 f[M][2];
  for (int t = 0; t < M; ++t) f[t][0] = f[t][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f);
  for (int64_t u = 0; u < units; ++u, w += ub) {
    pf_line(w, dist);
    for (int b = 0; b < 2; ++b) {
      const int64_t kb = 2 * u + b;
      const uint8_t* q = w + 64 + b * qb;
      __m256i is[M][2];
      for (int t = 0; t < M; ++t) is[t][0] = is[t][1] = _mm256_setzero_si256();
      for (int hh = 0; hh < 2; ++hh) {
        if constexpr (Fmt == kQ8_0) {
          for (int j = 0; j < 8; ++j) {
            if (hh == 0) pf_line(q + 64 * j, dist);
            const __m256i wv = _mm256_xor_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(q + 64 * j + 32 * hh)),
                                                _mm256_set1_epi8(char(0x80)));  // the signed q (stored q + 128)
            const __m256i aw = _mm256_sign_epi8(wv, wv);
            for (int t = 0; t < M; ++t) {
              const __m256i sx = _mm256_sign_epi8(bcast4(xq + (kb * ld + t) * kQK + 4 * j), wv);
              is[t][hh] = _mm256_add_epi32(is[t][hh], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
            }
          }
        } else {
          for (int j = 0; j < 4; ++j) {
            if (hh == 0) pf_line(q + 64 * j, dist);
            const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + 64 * j + 32 * hh));
            const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (int t = 0; t < M; ++t) {
              const int8_t* xb = xq + (kb * ld + t) * kQK;
              const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xb + 4 * j)),
                                                 _mm256_maddubs_epi16(hi, bcast4(xb + 16 + 4 * j)));
              is[t][hh] = _mm256_add_epi32(is[t][hh], _mm256_madd_epi16(p, ones));
            }
          }
        }
      }
      for (int hh = 0; hh < 2; ++hh) {
        const __m256 dw = scales8(w + 32 * b + 16 * hh);
        for (int t = 0; t < M; ++t) {
          __m256i v = is[t][hh];
          if constexpr (Fmt == kQ4_0) v = _mm256_add_epi32(v, _mm256_set1_epi32(xs[kb * ld + t]));  // -8 sum(x_q)
          f[t][hh] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(dw, _mm256_set1_ps(xd[kb * ld + t])),
                                     f[t][hh]);
        }
      }
    }
  }
  for (int t = 0; t < M; ++t)
    for (int hh = 0; hh < 2; ++hh) _mm256_storeu_ps(acc + t * kQRows + 8 * hh, f[t][hh]);
}

template <int Fmt, int M>
void mk_w_t(const uint8_t* w, int64_t units, const float* x, int64_t kp, float* acc, int64_t dist) {
  constexpr int64_t ub = Fmt == kQ8_0 ? 1088 : 576, qb = Fmt == kQ8_0 ? 512 : 256;
  __m256 f[M][2];
  for (int t = 0; t < M; ++t) f[t][0] = f[t][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi32(0x0f), eight = _mm256_set1_epi32(8);
  for (int64_t u = 0; u < units; ++u, w += ub) {
    pf_line(w, dist);
    for (int b = 0; b < 2; ++b) {
      const int64_t k0 = (2 * u + b) * kQK;
      const uint8_t* q = w + 64 + b * qb;
      for (int hh = 0; hh < 2; ++hh) {
        __m256 s[M];
        for (int t = 0; t < M; ++t) s[t] = _mm256_setzero_ps();
        if constexpr (Fmt == kQ8_0) {
          for (int j = 0; j < 8; ++j) {
            if (hh == 0) pf_line(q + 64 * j, dist);
            const __m256i v = _mm256_xor_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(q + 64 * j + 32 * hh)),
                                               _mm256_set1_epi8(char(0x80)));
            __m256 c[4];
            c[0] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24));
            c[1] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24));
            c[2] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 8), 24));
            c[3] = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 24));
            for (int t = 0; t < M; ++t)
              for (int i = 0; i < 4; ++i)
                s[t] = _mm256_fmadd_ps(c[i], _mm256_set1_ps(x[t * kp + k0 + 4 * j + i]), s[t]);
          }
        } else {
          for (int j = 0; j < 4; ++j) {
            if (hh == 0) pf_line(q + 64 * j, dist);
            const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + 64 * j + 32 * hh));
            for (int i = 0; i < 4; ++i) {
              const __m256 lo = _mm256_cvtepi32_ps(
                  _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(v, 8 * i), low), eight));
              const __m256 hi = _mm256_cvtepi32_ps(
                  _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(v, 8 * i + 4), low), eight));
              for (int t = 0; t < M; ++t) {
                s[t] = _mm256_fmadd_ps(lo, _mm256_set1_ps(x[t * kp + k0 + 4 * j + i]), s[t]);
                s[t] = _mm256_fmadd_ps(hi, _mm256_set1_ps(x[t * kp + k0 + 16 + 4 * j + i]), s[t]);
              }
            }
          }
        }
        const __m256 dw = scales8(w + 32 * b + 16 * hh);
        for (int t = 0; t < M; ++t) f[t][hh] = _mm256_fmadd_ps(s[t], dw, f[t][hh]);
      }
    }
  }
  for (int t = 0; t < M; ++t)
    for (int hh = 0; hh < 2; ++hh) _mm256_storeu_ps(acc + t * kQRows + 8 * hh, f[t][hh]);
}

int64_t stream_distance() {
  const StreamTuning st = stream_tuning();
  return (st.hint != kHintNone ? st.distance : 0) | (st.far << 32);
}

void mk_a8(int fmt, const uint8_t* w, int64_t units, const int8_t* xq, const float* xd, const int32_t* xs,
           int64_t ld, int m, float* acc) {
  const int64_t d = stream_distance();
  if (fmt == kQ8_0) (m == 1 ? mk_a8_t<kQ8_0, 1> : mk_a8_t<kQ8_0, 2>)(w, units, xq, xd, xs, ld, acc, d);
  else (m == 1 ? mk_a8_t<kQ4_0, 1> : mk_a8_t<kQ4_0, 2>)(w, units, xq, xd, xs, ld, acc, d);
}
void mk_w(int fmt, const uint8_t* w, int64_t units, const float* x, int64_t kp, int m, float* acc) {
  const int64_t d = stream_distance();
  if (fmt == kQ8_0) (m == 1 ? mk_w_t<kQ8_0, 1> : mk_w_t<kQ8_0, 2>)(w, units, x, kp, acc, d);
  else (m == 1 ? mk_w_t<kQ4_0, 1> : mk_w_t<kQ4_0, 2>)(w, units, x, kp, acc, d);
}

}  // namespace

extern const QuantOps kQuantAvx2Ops = {"avx2", kMr, mk_a8, mk_w, quant_row_generic, quant_row_f32_generic,
                                       silu_mul_f32_generic};

}  // namespace fk

#pragma GCC pop_options
#endif  // __x86_64__

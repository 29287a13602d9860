// AVX-512 F path for CPUs with AVX-512 but no AVX512-BF16 (Skylake-SP, Cascade Lake and Ice Lake Xeons, VMs that
// hide BF16): the AVX2 path's arithmetic on zmm. Same packed layout: a 32-bit lane holds one row's column pair, so
// `lane << 16` and `lane & 0xffff0000` are exactly the two fp32 weights. Each call widens its tokens' columns to fp32
// once (a slice at a time, on the stack), so every product's x is a broadcast load that the FMA takes as its
// operand; 12 tokens a call share each kp row's weights (24 accumulators of 32). Every output sums in the AVX2 path's
// order (per row: the even column's product, then the odd one's, kp by kp), so the bits are the AVX2 path's.
// An Intel Xeon without BF16 (family 6 model 207) ran a sketch of this 2.4x the AVX2 micro-kernel's speed at 16
// tokens in L2 (results/measured/2026-12-07-intel-xeon-noamx-issue54-avx512f-bf16-sketch/).
// Everything below the target pragma is compiled for AVX-512 F and only called after the run-time check (fk_cpu.cpp).
#include <immintrin.h>

#include <algorithm>

#include "fk.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

namespace fk {
namespace {

// 12 tokens x 32 rows = 24 zmm accumulators + 4 weight registers. From 64 tokens up 8 a call ran as fast (261
// GFLOP/s on 2 threads, Intel Xeon family 6 model 207): 12 takes 9-12 tokens in one pass of the weights instead of
// two (12 tokens: 16.1 against 21.5 ms on a 4096 x 14336 expert)
constexpr int kMr = 12;
constexpr int64_t kSlice = 128;  // kp rows widened at a time: 12 tokens x 256 fp32 = 12 KiB of stack

// xs[t][0, 2n) = fp32(x[t][0, 2n)), 2n a multiple of 16 (kpairs is: K is padded to kAlignK)
template <int M>
inline void widen(const uint16_t* x, int64_t ldx, int64_t n, float (*xs)[2 * kSlice]) {
  for (int t = 0; t < M; ++t)
    for (int64_t i = 0; i < 2 * n; i += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + t * ldx + i));
      _mm512_store_si512(xs[t] + i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
}

// acc[M][32] (+)= W[kp][32][2] . x[M][2kp..]: a 128-byte kp row is 2 registers of 16 rows' pairs.
// Streaming (pf_lines <= 0): the weight stream's prefetch (Hint, dist, far; fk_tuning.cpp); else the chunk was
// pulled into cache by the previous chunk's calls and this call pulls its share of the next one (pf, pf_lines).
template <int M, int Hint>
void mk(const uint16_t* w, int64_t kpairs, const uint16_t* x, int64_t ldx, float* acc, bool accumulate,
        const char* pf, int64_t pf_lines, int64_t dist, int64_t far) {
  __m512 c[M][2];
  for (int t = 0; t < M; ++t)
    for (int j = 0; j < 2; ++j)
      c[t][j] = accumulate ? _mm512_loadu_ps(acc + t * kBlockN + 16 * j) : _mm512_setzero_ps();
  alignas(64) float xs[M][2 * kSlice];
  const __m512i hi_mask = _mm512_set1_epi32(int(0xffff0000u));
  const bool streaming = pf_lines <= 0;
  const int64_t per = streaming ? 0 : (pf_lines + kpairs - 1) / kpairs;
  const char* wp = reinterpret_cast<const char*>(w);
  for (int64_t k0 = 0; k0 < kpairs; k0 += kSlice) {
    const int64_t n = std::min(kSlice, kpairs - k0);
    widen<M>(x + 2 * k0, ldx, n, xs);
    for (int64_t kp = 0; kp < n; ++kp, wp += 128) {
      prefetch_kernel_step<Hint>(wp, streaming, dist, far, pf, pf_lines, per);
      const __m512i v0 = _mm512_load_si512(wp), v1 = _mm512_load_si512(wp + 64);
      const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16));
      const __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(v0, hi_mask));
      const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));
      const __m512 o1 = _mm512_castsi512_ps(_mm512_and_si512(v1, hi_mask));
      for (int t = 0; t < M; ++t) {
        const __m512 xe = _mm512_set1_ps(xs[t][2 * kp]), xo = _mm512_set1_ps(xs[t][2 * kp + 1]);
        c[t][0] = _mm512_fmadd_ps(o0, xo, _mm512_fmadd_ps(e0, xe, c[t][0]));
        c[t][1] = _mm512_fmadd_ps(o1, xo, _mm512_fmadd_ps(e1, xe, c[t][1]));
      }
    }
  }
  for (int t = 0; t < M; ++t)
    for (int j = 0; j < 2; ++j) _mm512_storeu_ps(acc + t * kBlockN + 16 * j, c[t][j]);
}

using MkFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, bool, const char*, int64_t,
                      int64_t, int64_t);
template <int Hint>
constexpr MkFn kMkRow[kMr] = {mk<1, Hint>, mk<2, Hint>, mk<3, Hint>, mk<4, Hint>,
                              mk<5, Hint>, mk<6, Hint>, mk<7, Hint>, mk<8, Hint>,
                              mk<9, Hint>, mk<10, Hint>, mk<11, Hint>, mk<12, Hint>};
constexpr const MkFn* kMk[kNumHints] = {kMkRow<kHintNone>, kMkRow<kHintT0>, kMkRow<kHintT1>, kMkRow<kHintNta>};

void mk_avx512f(const uint16_t* w, int64_t kpairs, const uint16_t* x, int64_t ldx, int m, float* acc,
                bool accumulate, const char* pf, int64_t pf_lines) {
  const StreamTuning st = stream_tuning();
  kMk[st.hint][m - 1](w, kpairs, x, ldx, acc, accumulate, pf, pf_lines, st.distance, st.far);
}

template <int Hint>
uint64_t read512(const char* q, int64_t n, int64_t dist) {
  __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
  for (int64_t i = 0; i < n; i += 256) {
    if constexpr (Hint != kHintNone)
      for (int l = 0; l < 256; l += 64) prefetch<Hint>(q + i + dist + l);
    s0 = _mm512_xor_si512(s0, _mm512_load_si512(q + i));
    s1 = _mm512_xor_si512(s1, _mm512_load_si512(q + i + 64));
    s2 = _mm512_xor_si512(s2, _mm512_load_si512(q + i + 128));
    s3 = _mm512_xor_si512(s3, _mm512_load_si512(q + i + 192));
  }
  return uint64_t(_mm512_reduce_add_epi64(_mm512_xor_si512(_mm512_xor_si512(s0, s1), _mm512_xor_si512(s2, s3))));
}

}  // namespace

uint64_t read_avx512(const void* p, int64_t n, int hint, int64_t dist) {
  const char* q = static_cast<const char*>(p);
  switch (hint) {
    case kHintT0: return read512<kHintT0>(q, n, dist);
    case kHintT1: return read512<kHintT1>(q, n, dist);
    case kHintNta: return read512<kHintNta>(q, n, dist);
    default: return read512<kHintNone>(q, n, dist);
  }
}

extern const IsaOps kAvx512FOps = {"avx512", kMr, mk_avx512f, silu_mul_avx2, store_avx2, read_avx512, nullptr};

}  // namespace fk

#pragma GCC pop_options
#endif  // __x86_64__

// Causal prefill attention (every query at positions 0..T-1 over keys 0..T-1, GQA), bf16 in and out,
// for the AVX512-BF16 path: the two products by vdpbf16ps micro-kernels, the softmax as torch's CPU
// flash attention computes it.
//
// Why: torch's CPU flash attention (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp) reads 75-150
// GFLOP/s on a Zen 5 core pair at 512-4096 tokens, where the same cores multiply bf16 at ~800; at
// 4096 tokens attention is a third of a small_mixtral prefill.
//
// Numerics follow torch's kernel (as fk_decode_impl.h does for one query): key blocks of 512 aligned
// to 0; per block s = (q.k) * scale in fp32, masked keys -inf, the row max, p = exp(s - max) by
// ATen's fexp_u20 over the full 16-key chunks of the block and expf on its tail, the sum as 16 lanes
// reduced pairwise and the tail in order, p rounded to bf16 for p @ V, running sum and accumulator
// rescaled by exp(old max - new max), out = bf16(acc * (1 / sum)). Keys masked for every row of a
// tile are skipped (in torch they add exact zeros). Not reproduced: the summation order of torch's
// two gemms (fp32 sums of exact bf16 products in both), so an output can differ from torch's by a
// bf16 rounding step (tests/test_attention_kernel.py).
//
// Layout: K of each (sequence, KV head) packed as [T/16][dk/2][16 keys][2] so one zmm holds a dim pair
// of 16 keys; V as [T/2][dv][2 keys]. A tile is 8 consecutive queries of one head: q.k as 8 x 32
// accumulators over dk/2 pairs (2 key loads, 8 broadcast query pairs, 16 vdpbf16ps), p @ V per
// 16-dim chunk of dv as 8 accumulators over key pairs (1 value load, 8 broadcast p pairs).
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fk_api.h"
#include "fk_internal.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace fk {
namespace {

constexpr int kRows = 8;          // queries per tile
constexpr int64_t kKvSplit = 512;  // torch's kv_split_size
constexpr int64_t kMaxD = 256;

inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// fk_decode_impl.h's fexp_u20 (ATen's Vectorized<float>::fexp_u20), 16 lanes, the same operations
__m512 fexp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(bits_f32(0xc2aeac50u)), hi = _mm512_set1_ps(bits_f32(0x42b17218u));
  const __mmask16 m_lo = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), m_hi = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
  const __mmask16 m_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  __m512 src = _mm512_mul_ps(x, _mm512_set1_ps(bits_f32(0x3fb8aa3bu)));
  const __m512 fr = _mm512_sub_ps(src, _mm512_roundscale_ps(src, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
  __m512 res = _mm512_fmadd_ps(fr, _mm512_set1_ps(float(-0.079204240219773236)), _mm512_set1_ps(float(-0.22433836478672356)));
  res = _mm512_fmadd_ps(fr, res, _mm512_set1_ps(0.30354260500649682f));
  res = _mm512_fmadd_ps(fr, res, _mm512_set1_ps(0.00010703434948458272f));
  src = _mm512_sub_ps(src, res);
  const __m512 t = _mm512_fmadd_ps(_mm512_set1_ps(8388608.0f), src, _mm512_set1_ps(8388608.0f * 127.0f));
  __m512 r = _mm512_castsi512_ps(_mm512_cvttps_epi32(t));
  r = _mm512_mask_mov_ps(r, m_lo, _mm512_setzero_ps());
  r = _mm512_mask_mov_ps(r, m_hi, _mm512_set1_ps(INFINITY));
  return _mm512_mask_mov_ps(r, m_nan, x);
}

// fp32 -> bf16, round to nearest even (as fk_decode_impl.h's st for finite values)
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

inline float ld(uint16_t h) { return bits_f32(uint32_t(h) << 16); }

inline uint16_t st(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// s[r][0..16 NC) = (q[r] . k[key]) * scale for NC chunks of 16 keys; q: [kRows][dk] bf16 (dense),
// kp: the first chunk, chunks `cs` elements apart
template <int NC>
inline void qk(const uint16_t* q, int64_t dk, const uint16_t* kp, int64_t cs, float scale, float* s, int64_t lds) {
  __m512 c[kRows][NC];
  for (int r = 0; r < kRows; ++r)
    for (int n = 0; n < NC; ++n) c[r][n] = _mm512_setzero_ps();
  const int* qi = reinterpret_cast<const int*>(q);
  const int64_t qpairs = dk / 2;
  for (int64_t p = 0; p < qpairs; ++p) {
    __m512i kv[NC];
    for (int n = 0; n < NC; ++n) kv[n] = _mm512_loadu_si512(kp + n * cs + p * 32);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(qi[r * qpairs + p]);
      for (int n = 0; n < NC; ++n) c[r][n] = _mm512_dpbf16_ps(c[r][n], qb, (__m512bh)kv[n]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < kRows; ++r)
    for (int n = 0; n < NC; ++n) _mm512_storeu_ps(s + r * lds + 16 * n, _mm512_mul_ps(c[r][n], sc));
}

// o[r][0..dv) += sum over key pairs [0, pairs) of p[r][pair] . v[pair]; p: bf16 [kRows][ldp] (pairs of
// keys), vp: [pairs][dv][2]
inline void pv(const uint16_t* p, int64_t ldp, int64_t pairs, const uint16_t* vp, int64_t dv, float* o) {
  const int* pi = reinterpret_cast<const int*>(p);
  for (int64_t c0 = 0; c0 < dv; c0 += 16) {
    __m512 acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_loadu_ps(o + r * dv + c0);
    const uint16_t* v = vp + 2 * c0;
    for (int64_t j = 0; j < pairs; ++j, v += 2 * dv) {
      const __m512bh vv = (__m512bh)_mm512_loadu_si512(v);
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pi[r * (ldp / 2) + j]), vv);
    }
    for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(o + r * dv + c0, acc[r]);
  }
}

struct Args {
  const uint16_t *q, *k, *v;
  int64_t B, nh, nkv, T, dk, dv, q_sb, q_sh, q_st, k_sb, k_sg, k_st, v_sb, v_sg, v_st;
  float scale;
  uint16_t* out;
  int64_t Tp;               // T rounded up to 16
  uint16_t *kpack, *vpack;  // per (b, g): Tp * dk and Tp * dv elements
};

void pack_head(const Args& a, int64_t bg) {
  const int64_t b = bg / a.nkv, g = bg % a.nkv;
  const uint16_t* k = a.k + b * a.k_sb + g * a.k_sg;
  const uint16_t* v = a.v + b * a.v_sb + g * a.v_sg;
  uint16_t* kp = a.kpack + bg * a.Tp * a.dk;
  uint16_t* vp = a.vpack + bg * a.Tp * a.dv;
  for (int64_t j = 0; j < a.Tp; ++j) {  // key j: chunk j/16, lane j%16
    uint16_t* dst = kp + (j / 16) * 16 * a.dk + (j % 16) * 2;
    const uint16_t* src = k + j * a.k_st;
    for (int64_t p = 0; p < a.dk / 2; ++p) {
      dst[p * 32] = j < a.T ? src[2 * p] : 0;
      dst[p * 32 + 1] = j < a.T ? src[2 * p + 1] : 0;
    }
    uint16_t* vd = vp + (j / 2) * 2 * a.dv + (j % 2);
    const uint16_t* vs = v + j * a.v_st;
    for (int64_t i = 0; i < a.dv; ++i) vd[2 * i] = j < a.T ? vs[i] : 0;
  }
}

struct Scratch {
  alignas(64) uint16_t q[kRows * kMaxD];
  alignas(64) float s[kRows * kKvSplit];
  alignas(64) uint16_t p[kRows * kKvSplit];
  alignas(64) float o[kRows * kMaxD];
};

// Tile `item`: the most expensive tiles (the last queries) first, for the pool's guided split.
void tile(const Args& a, int64_t item, Scratch& w) {
  const int64_t tiles = (a.T + kRows - 1) / kRows, heads = a.B * a.nh;
  const int64_t ti = tiles - 1 - item / heads, bh = item % heads;
  const int64_t b = bh / a.nh, h = bh % a.nh, g = h / (a.nh / a.nkv), bg = b * a.nkv + g;
  const int64_t t0 = ti * kRows, R = std::min<int64_t>(kRows, a.T - t0), te = t0 + R;
  const int64_t dk = a.dk, dv = a.dv;
  for (int r = 0; r < kRows; ++r) {
    if (r < R) std::memcpy(w.q + r * dk, a.q + b * a.q_sb + h * a.q_sh + (t0 + r) * a.q_st, size_t(dk) * 2);
    else std::memset(w.q + r * dk, 0, size_t(dk) * 2);
  }
  std::memset(w.o, 0, sizeof(float) * kRows * dv);
  float m_run[kRows], sum_run[kRows];
  for (int r = 0; r < kRows; ++r) m_run[r] = -INFINITY, sum_run[r] = 0.0f;
  const uint16_t* kp = a.kpack + bg * a.Tp * dk;
  const uint16_t* vp = a.vpack + bg * a.Tp * dv;
  for (int64_t b0 = 0; b0 < te; b0 += kKvSplit) {
    const int64_t e = std::min(b0 + kKvSplit, a.T);          // torch's block
    const int64_t kend = std::min(e, te), n16 = (kend - b0 + 15) / 16 * 16;  // keys this tile needs
    const int64_t vec_end = (e - b0) / 16 * 16;               // relative: torch's vector part
    int64_t c = 0;
    for (; c + 32 <= n16; c += 32) qk<2>(w.q, dk, kp + (b0 + c) * dk, 16 * dk, a.scale, w.s + c, kKvSplit);
    if (c < n16) qk<1>(w.q, dk, kp + (b0 + c) * dk, 16 * dk, a.scale, w.s + c, kKvSplit);
    for (int r = 0; r < kRows; ++r) {
      float* s = w.s + r * kKvSplit;
      uint16_t* p = w.p + r * kKvSplit;
      for (int64_t j = std::max<int64_t>(0, t0 + r + 1 - b0); j < n16; ++j) s[j] = -INFINITY;  // causal
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int64_t j = 0; j < n16; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
      const float bmax = _mm512_reduce_max_ps(mx);
      const float tmax = m_run[r] > bmax ? m_run[r] : bmax;
      const __m512 tm = _mm512_set1_ps(tmax);
      __m512 lane = _mm512_setzero_ps();
      const int64_t vend = std::min(n16, vec_end);
      int64_t j = 0;
      for (; j < vend; j += 16) {
        const __m512 e16 = fexp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), tm));
        lane = _mm512_add_ps(lane, e16);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), to_bf16(e16));
      }
      alignas(64) float l[16];
      _mm512_store_ps(l, lane);
      for (int wdt = 8; wdt >= 1; wdt /= 2)
        for (int i = 0; i < wdt; ++i) l[i] += l[i + wdt];
      float tsum = l[0];
      for (; j < kend - b0; ++j) {  // torch's scalar tail (the block's last keys, past its 16-chunks)
        const float ex = std::exp(s[j] - tmax);
        tsum += ex;
        p[j] = st(ex);
      }
      for (; j < n16; ++j) p[j] = 0;  // padding past the sequence
      const float exp_tmp = std::exp(m_run[r] - tmax);
      sum_run[r] = tsum + exp_tmp * sum_run[r];
      m_run[r] = tmax;
      if (b0 > 0) {
        const __m512 et = _mm512_set1_ps(exp_tmp);
        for (int64_t i = 0; i < dv; i += 16)
          _mm512_storeu_ps(w.o + r * dv + i, _mm512_mul_ps(_mm512_loadu_ps(w.o + r * dv + i), et));
      }
    }
    pv(w.p, kKvSplit, n16 / 2, vp + b0 * dv, dv, w.o);
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.0f / sum_run[r];
    uint16_t* dst = a.out + ((b * a.T + t0 + r) * a.nh + h) * dv;
    for (int64_t i = 0; i < dv; ++i) dst[i] = st(w.o[r * dv + i] * inv);
  }
}

}  // namespace

int causal_attention(const Args& a, int threads) {
  const int64_t heads = a.B * a.nkv;
  parallel_for(threads, heads, [](const void* c, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) pack_head(*static_cast<const Args*>(c), i);
  }, &a);
  const int64_t items = ((a.T + kRows - 1) / kRows) * a.B * a.nh;
  parallel_for(threads, items, [](const void* c, int64_t b, int64_t e) {
    thread_local std::vector<char> buf;
    if (buf.size() < sizeof(Scratch) + 64) buf.resize(sizeof(Scratch) + 64);
    auto* w = reinterpret_cast<Scratch*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
    for (int64_t i = b; i < e; ++i) tile(*static_cast<const Args*>(c), i, *w);
  }, &a);
  return 0;
}

}  // namespace fk

#pragma GCC pop_options
#endif

// Causal attention of T queries over T keys (positions 0..T-1) for B sequences: q [B][nh][T][dk] and
// k [B][nkv][T][dk], v [B][nkv][T][dv] given by their strides in elements (the last dim dense), out
// [B][T][nh][dv] dense (o_proj's input). nh a multiple of nkv; dk even, dv a multiple of 16, both at
// most 256. Needs the AVX512-BF16 path (kIsaAvx512Bf16); otherwise -1 and the caller uses torch.
FK_API int fk_causal_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t B,
                                    int64_t nh, int64_t nkv, int64_t T, int64_t dk, int64_t dv, int64_t q_sb,
                                    int64_t q_sh, int64_t q_st, int64_t k_sb, int64_t k_sg, int64_t k_st,
                                    int64_t v_sb, int64_t v_sg, int64_t v_st, float scale, uint16_t* out,
                                    int threads) {
#if defined(__x86_64__)
  using namespace fk;
  if (current_isa() != kIsaAvx512Bf16) return fail("causal attention: needs the avx512_bf16 path");
  if (B < 1 || T < 1 || nh < 1 || nkv < 1 || nh % nkv || dk < 2 || dk % 2 || dk > kMaxD || dv < 16 ||
      dv % 16 || dv > kMaxD)
    return fail("causal attention: bad shape");
  Args a{q, k, v, B, nh, nkv, T, dk, dv, q_sb, q_sh, q_st, k_sb, k_sg, k_st, v_sb, v_sg, v_st, scale, out,
         (T + 15) / 16 * 16, nullptr, nullptr};
  std::vector<uint16_t> kp(size_t(B * nkv * a.Tp * dk)), vp(size_t(B * nkv * a.Tp * dv));
  a.kpack = kp.data();
  a.vpack = vp.data();
  return causal_attention(a, threads);
#else
  return fk::fail("causal attention: x86-64 only");
#endif
}

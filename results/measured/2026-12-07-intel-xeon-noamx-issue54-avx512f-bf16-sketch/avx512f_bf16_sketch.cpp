// standalone: AVX2 kernel of fk_avx2.cpp (2 tokens a call) vs an AVX-512F sketch (widened x, 8 tokens a call),
// one thread, weights of 8 blocks x K=4096 (32 rows each) in L2, 16 tokens; ns per (block row-pair kp, token).
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#pragma GCC target("avx2,fma,avx512f,avx512bw")
constexpr int kBlockN = 32;
template <int M>
void mk2(const uint16_t* w, int64_t kpairs, const uint16_t* x, int64_t ldx, float* acc) {
  __m256 c[M][4];
  for (int t = 0; t < M; ++t) for (int j = 0; j < 4; ++j) c[t][j] = _mm256_setzero_ps();
  const __m256i hi = _mm256_set1_epi32(int(0xffff0000u));
  const char* wp = (const char*)w;
  for (int64_t kp = 0; kp < kpairs; ++kp, wp += 128) {
    __m256 xe[M], xo[M];
    for (int t = 0; t < M; ++t) { int pair; memcpy(&pair, x + t * ldx + 2 * kp, 4); __m256i p = _mm256_set1_epi32(pair);
      xe[t] = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16)); xo[t] = _mm256_castsi256_ps(_mm256_and_si256(p, hi)); }
    for (int j = 0; j < 4; ++j) { __m256i v = _mm256_load_si256((const __m256i*)(wp + 32 * j));
      __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), o = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
      for (int t = 0; t < M; ++t) c[t][j] = _mm256_fmadd_ps(o, xo[t], _mm256_fmadd_ps(e, xe[t], c[t][j])); }
  }
  for (int t = 0; t < M; ++t) for (int j = 0; j < 4; ++j) _mm256_storeu_ps(acc + t * kBlockN + 8 * j, c[t][j]);
}
template <int M>
void mk512(const uint16_t* w, int64_t kpairs, const float* xf, int64_t ldf, float* acc) {
  __m512 a0[M], a1[M];
#pragma GCC unroll 8
  for (int t = 0; t < M; ++t) { a0[t] = _mm512_setzero_ps(); a1[t] = _mm512_setzero_ps(); }
  const char* wp = (const char*)w;
  for (int64_t kp = 0; kp < kpairs; ++kp, wp += 128) {
    __m512i v0 = _mm512_load_si512(wp), v1 = _mm512_load_si512(wp + 64);
    __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)), o0 = _mm512_castsi512_ps(_mm512_and_si512(v0, _mm512_set1_epi32(int(0xffff0000u))));
    __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16)), o1 = _mm512_castsi512_ps(_mm512_and_si512(v1, _mm512_set1_epi32(int(0xffff0000u))));
#pragma GCC unroll 8
    for (int t = 0; t < M; ++t) {
      const __m512 xe = _mm512_set1_ps(xf[t * ldf + 2 * kp]), xo = _mm512_set1_ps(xf[t * ldf + 2 * kp + 1]);
      a0[t] = _mm512_fmadd_ps(o0, xo, _mm512_fmadd_ps(e0, xe, a0[t]));
      a1[t] = _mm512_fmadd_ps(o1, xo, _mm512_fmadd_ps(e1, xe, a1[t]));
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < M; ++t) { _mm512_storeu_ps(acc + t * kBlockN, a0[t]); _mm512_storeu_ps(acc + t * kBlockN + 16, a1[t]); }
}
int main() {
  const int64_t K = 4096, kpairs = K / 2, blocks = 8, T = 16;
  std::vector<uint16_t> w(blocks * kpairs * 64 + 64); uint16_t* wa = (uint16_t*)(((uintptr_t)w.data() + 63) & ~63ull);
  for (size_t i = 0; i < blocks * kpairs * 64; ++i) wa[i] = 0x3c00 + (i % 97);
  std::vector<uint16_t> x(T * K); for (size_t i = 0; i < x.size(); ++i) x[i] = 0x3f80 + (i % 13);
  std::vector<float> xf(T * K); for (size_t i = 0; i < x.size(); ++i) { uint32_t u = uint32_t(x[i]) << 16; memcpy(&xf[i], &u, 4); }
  std::vector<float> acc(T * kBlockN), acc2(T * kBlockN);
  for (int round = 0; round < 3; ++round) {
    double b2 = 1e9, b5 = 1e9;
    for (int r = 0; r < 200; ++r) {
      auto a = std::chrono::steady_clock::now();
      for (int b = 0; b < blocks; ++b) for (int t0 = 0; t0 < T; t0 += 2) mk2<2>(wa + b * kpairs * 64, kpairs, x.data() + t0 * K, K, acc.data() + t0 * kBlockN);
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count(); if (s < b2) b2 = s;
      a = std::chrono::steady_clock::now();
      for (int b = 0; b < blocks; ++b) for (int t0 = 0; t0 < T; t0 += 8) mk512<8>(wa + b * kpairs * 64, kpairs, xf.data() + t0 * K, K, acc2.data() + t0 * kBlockN);
      s = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count(); if (s < b5) b5 = s;
    }
    const double units = double(blocks) * kpairs * T;
    printf("avx2 (2 tokens a call) %.3f ns, avx512f sketch (8 tokens, widened x) %.3f ns per kp-row and token; ratio %.2f; same %d\n",
           b2 / units * 1e9, b5 / units * 1e9, b2 / b5, memcmp(acc.data(), acc2.data(), acc.size() * 4) == 0);
  }
}

#include <immintrin.h>
#include <x86intrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <algorithm>
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")
constexpr int kQK=32, kQRows=16, kQ8_0=0, kQ4_0=1;
struct alignas(64) QTileConfig { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
int64_t g_near = 1024, g_far = 4096; int g_shift = 0;
constexpr int kQ4Lag = 2, kQ4Ring = 4;
inline void q8_sign_unit(const uint8_t* w, int8_t (*bq)[8][64]) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int b = 0; b < 2; ++b) for (int j = 0; j < 8; ++j)
    _mm512_store_si512(bq[b][j], _mm512_xor_si512(_mm512_load_si512(w + 64 + b * 512 + 64 * j), flip));
}
inline void q4_unpack_gfni(const uint8_t* w, int8_t (*bq)[8][64]) {
  const __m512i lo = _mm512_set1_epi64(0x0102040808080808ll), hi = _mm512_set1_epi64(0x1020408080808080ll);
  for (int b = 0; b < 2; ++b) for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_load_si512(w + 64 + b * 256 + 64 * j);
      _mm512_store_si512(bq[b][j], _mm512_gf2p8affine_epi64_epi8(v, lo, 0xF8));
      _mm512_store_si512(bq[b][4 + j], _mm512_gf2p8affine_epi64_epi8(v, hi, 0xF8)); }
}
inline void q4_unpack_unit(const uint8_t* w, int8_t (*bq)[8][64]) {
  const __m512i low = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi8(8);
  for (int b = 0; b < 2; ++b) for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_load_si512(w + 64 + b * 256 + 64 * j);
      _mm512_store_si512(bq[b][j], _mm512_sub_epi8(_mm512_and_si512(v, low), eight));
      _mm512_store_si512(bq[b][4 + j], _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), eight)); }
}
// VAR bits: 1 = skip scale, 2 = skip store, 4 = lag2 cbuf
template <int Fmt, int M, int VAR>
void qamx(const uint8_t* w, int64_t units, const int8_t* xq, const float* xd, const int32_t* xs, int64_t ld, float* acc) {
  constexpr int64_t ub = Fmt == kQ8_0 ? 1088 : 576;
  QTileConfig cfg = {}; cfg.palette = 1;
  for (int t = 0; t < 4; ++t) { cfg.rows[t] = M; cfg.colsb[t] = 64; }
  for (int t = 4; t < 6; ++t) { cfg.rows[t] = M; cfg.colsb[t] = kQK; }
  for (int t = 6; t < 8; ++t) { cfg.rows[t] = 8; cfg.colsb[t] = 64; }
  asm volatile("" ::: "memory"); _tile_loadconfig(&cfg);
  constexpr int NB = (VAR & 4) ? 4 : 2; constexpr int LAG = (VAR & 4) ? 2 : 1;
  alignas(64) int32_t cbuf[NB][2][16][16]; alignas(64) static int32_t cother[NB][2][16][16]; if (VAR & 64) memset(cbuf, 1, sizeof cbuf);
  alignas(64) int8_t bq[kQ4Ring][2][Fmt==kQ8_0?8:8][64];
  __m512 f[M]; for (int t = 0; t < M; ++t) f[t] = _mm512_setzero_ps();
  constexpr bool RING = Fmt == kQ4_0 || (VAR & 8);
  auto unpack = [&](const uint8_t* p, int8_t (*d)[8][64]) { if constexpr (Fmt == kQ4_0) { if constexpr (VAR & 32) q4_unpack_gfni(p, d); else q4_unpack_unit(p, d); } else q8_sign_unit(p, d); };
  if constexpr (RING) for (int64_t v = 0; v < kQ4Lag && v < units; ++v) unpack(w + v * ub, bq[v % kQ4Ring]);
  for (int64_t u = 0; u < units + LAG; ++u) {
    const uint8_t* wu = w + u * ub;
    if (u < units && !(VAR & 64)) {
      for (int64_t l = 0; l < ub; l += 64) { const uint8_t* pb = wu + (RING && g_shift ? kQ4Lag * ub : 0) + l; if (g_near) _mm_prefetch((const char*)(pb + g_near), _MM_HINT_T0); if (g_far) _mm_prefetch((const char*)(pb + g_far), _MM_HINT_T1); }
      if constexpr (RING) if (u + kQ4Lag < units) unpack(wu + kQ4Lag * ub, bq[(u + kQ4Lag) % kQ4Ring]);
      const int8_t (*bu)[8][64] = bq[u % kQ4Ring];
      int32_t (*cb)[16][16] = cbuf[u % NB];
      const int64_t kb0 = 2*u;
#define BLK(c,a,bt,b) do { _tile_zero(c); _tile_loadd(a, xq + (kb0 + (b)) * ld * kQK, kQK); \
      if constexpr (!RING) { _tile_loadd(bt, w + u*ub + 64 + (b) * 512, 64); _tile_dpbsud(c, a, bt);} \
      else { _tile_loadd(bt, bu[b], 64); _tile_dpbssd(c, a, bt);} } while(0)
      if (u & 1) { BLK(2,4,6,0); BLK(3,5,7,1); if (!(VAR&2)) {_tile_stored(2, cb[0], 64); _tile_stored(3, cb[1], 64);} }
      else { BLK(0,4,6,0); BLK(1,5,7,1); if (!(VAR&2)) {_tile_stored(0, cb[0], 64); _tile_stored(1, cb[1], 64);} }
    }
    if (!(VAR & 1) && u >= LAG) {
      const int64_t uu = u - LAG; const uint8_t* wv = w + uu * ub; int32_t (*cb)[16][16] = (VAR & 128) ? cother[uu % NB] : cbuf[uu % NB];
      if constexpr (VAR & 16) {
        const __m512 dw0 = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(wv)));
        const __m512 dw1 = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(wv + 32)));
        const float* db0 = xd + (2*uu) * ld; const float* db1 = db0 + ld;
        const int32_t* sb0 = xs + (2*uu) * ld; const int32_t* sb1 = sb0 + ld;
#pragma GCC unroll 16
        for (int t = 0; t < M; ++t) {
          __m512i s0 = _mm512_load_si512(cb[0][t]), s1 = _mm512_load_si512(cb[1][t]);
          if constexpr (!RING) { s0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(128 * sb0[t])); s1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(128 * sb1[t])); }
          __m512 ft = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(dw0, _mm512_set1_ps(db0[t])), f[t]);
          ft = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(dw1, _mm512_set1_ps(db1[t])), ft);
          asm volatile("" : "+v"(ft));
          f[t] = ft;
        }
      } else
      for (int b = 0; b < 2; ++b) {
        const __m512 dw = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(wv + 32 * b)));
        const float* db = xd + (2*uu + b) * ld; const int32_t* sb = xs + (2*uu + b) * ld;
        for (int t = 0; t < M; ++t) {
          __m512i sum = _mm512_load_si512(cb[b][t]);
          if constexpr (!RING) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * sb[t]));
          f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(db[t])), f[t]);
        }
      }
    }
  }
  _tile_release();
  for (int t = 0; t < M; ++t) _mm512_storeu_ps(acc + t * kQRows, f[t]);
}
template <int Fmt, int VAR> double once(const uint8_t* w, int64_t units, const int8_t* xq, const float* xd, const int32_t* xs) {
  alignas(64) float acc[16*16];
  uint64_t t0 = __rdtsc(); qamx<Fmt,16,VAR>(w, units, xq, xd, xs, 16, acc); uint64_t t1 = __rdtsc();
  asm volatile("" :: "r"(acc) : "memory");
  return double(t1-t0) / (2*units);
}

#include <thread>
#include <vector>
double read_once(const uint8_t* w, int64_t bytes) {
  __m512i a = _mm512_setzero_si512();
  for (int64_t l = 0; l < bytes; l += 64) { _mm_prefetch((const char*)(w + l + 1024), _MM_HINT_T0); _mm_prefetch((const char*)(w + l + 4096), _MM_HINT_T1); a = _mm512_add_epi32(a, _mm512_load_si512(w + l)); }
  return _mm512_reduce_add_epi32(a);
}
int main(int argc, char** argv) {
  syscall(SYS_arch_prctl, 0x1023, 18);
  const int nth = argc > 1 ? atoi(argv[1]) : 1; if (argc > 3) { g_near = atoi(argv[2]); g_far = atoi(argv[3]); } if (argc > 4) g_shift = atoi(argv[4]);
  const int64_t units = argc > 5 ? atoi(argv[5]) : 64, groups = 4096 * 64 / units;  // K=4096 row groups; q8 ~285 MB, q4 ~151 MB per 4096 groups
  const int64_t NG = groups * 2;  // total groups > L3
  auto mk = [&](int64_t ub) { uint8_t* w = (uint8_t*)aligned_alloc(64, NG * units * ub);
    for (int64_t i = 0; i < NG * units * ub; i += 4096) w[i] = 1;
    for (int64_t u = 0; u < NG * units; ++u) { uint8_t* p = w + u * ub; for (int i = 64; i < ub; ++i) p[i] = (u * 7 + i * 13) & 0xff; for (int i = 0; i < 32; ++i) ((uint16_t*)p)[i] = 0x3c00; }
    return w; };
  uint8_t* w8 = mk(1088); uint8_t* w4 = mk(576);
  int8_t* xq = (int8_t*)aligned_alloc(64, 2*units*16*32); for (int64_t i = 0; i < 2*units*16*32; ++i) xq[i] = rand();
  float* xd = (float*)aligned_alloc(64, 2*units*16*4); for (int64_t i = 0; i < 2*units*16; ++i) xd[i] = 1.f;
  int32_t* xs = (int32_t*)aligned_alloc(64, 2*units*16*4); for (int64_t i = 0; i < 2*units*16; ++i) xs[i] = 1;
  struct V { const char* n; void (*f)(const uint8_t*, int64_t, const int8_t*, const float*, const int32_t*, int64_t, float*); bool q8; double best; };
  V vs[] = {{"q4 cur", qamx<kQ4_0,16,0>, false, 1e9}, {"q4 gfni", qamx<kQ4_0,16,32>, false, 1e9},
            {"q8 cur", qamx<kQ8_0,16,0>, true, 1e9}, {"q8 ring", qamx<kQ8_0,16,8>, true, 1e9},
            {"q8 ring noscl", qamx<kQ8_0,16,9>, true, 1e9}, {"q8 ring nostore", qamx<kQ8_0,16,11>, true, 1e9}, {"q4 gfni noscl", qamx<kQ4_0,16,33>, false, 1e9}, {"q4 read", nullptr, false, 1e9}, {"q8 read", nullptr, true, 1e9}};
  int64_t half = 0;
  for (int r = 0; r < 8; ++r) for (auto& v : vs) {
    const int64_t ub = v.q8 ? 1088 : 576; const uint8_t* base = (v.q8 ? w8 : w4) + (half ? groups * units * ub : 0);
    auto t0 = __rdtsc();
    std::vector<std::thread> th;
    for (int k = 0; k < nth; ++k) th.emplace_back([&, k] {
      alignas(64) float acc[256];
      const int64_t g0 = groups * k / nth, g1 = groups * (k + 1) / nth;
      if (v.f) for (int64_t g = g0; g < g1; ++g) v.f(base + g * units * ub, units, xq, xd, xs, 16, acc);
      else read_once(base + g0 * units * ub, (g1 - g0) * units * ub);
    });
    for (auto& t : th) t.join();
    v.best = std::min(v.best, double(__rdtsc() - t0) / (groups * units * 2) * nth);
    half ^= 1;
  }
  printf("near %ld far %ld:", g_near, g_far); for (auto& v : vs) printf(" %s %.1f |", v.n, v.best); printf("\n");
}

// AMX-INT8 path of the quantized a8 mode (fk_quant_amx_impl.h): the AVX-512 VNNI path with the
// micro-kernel replaced by tile products from qamx_min_tokens(fmt) tokens, and the same code on a software
// model of the tiles ("emulated", which the tests run on any AVX-512 VNNI CPU). The hardware variant is
// only called after fk_quant.cpp found AMX-INT8, obtained the tile-data permission and self-checked it.
#include <immintrin.h>

#include <cstring>

#include "fk_quant.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")

namespace fk {

namespace qamx_hw {
#define TILE_CONFIG(cfg) load_tile_config(cfg)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, p, s) _tile_loadd(t, p, s)
#define TILE_STORE(t, p, s) _tile_stored(t, p, s)
#define TILE_DP_SS(c, a, b) _tile_dpbssd(c, a, b)
#define TILE_RELEASE() _tile_release()
#include "fk_quant_amx_impl.h"
}  // namespace qamx_hw

// Software tiles: TDPBSSD is an exact int32 sum of signed byte products (wrapping, as the hardware).
namespace qamx_emu {
struct Tiles {
  uint8_t rows[8];
  uint16_t colsb[8];
  alignas(64) uint8_t data[8][16][64];
};
thread_local Tiles g_t;

void config(const void* p) {
  struct Cfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  };
  Cfg c;
  std::memcpy(&c, p, sizeof c);
  for (int t = 0; t < 8; ++t) {
    g_t.rows[t] = c.rows[t];
    g_t.colsb[t] = c.colsb[t];
  }
  std::memset(g_t.data, 0, sizeof g_t.data);
}
void zero(int t) { std::memset(g_t.data[t], 0, sizeof g_t.data[t]); }
void load(int t, const void* p, int64_t stride) {
  for (int r = 0; r < g_t.rows[t]; ++r) std::memcpy(g_t.data[t][r], static_cast<const char*>(p) + r * stride, g_t.colsb[t]);
}
void store(int t, void* p, int64_t stride) {
  for (int r = 0; r < g_t.rows[t]; ++r) std::memcpy(static_cast<char*>(p) + r * stride, g_t.data[t][r], g_t.colsb[t]);
}
void dp(int c, int a, int b) {
  const int m = g_t.rows[c], n = g_t.colsb[c] / 4, k = g_t.colsb[a];
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      uint32_t s;
      std::memcpy(&s, &g_t.data[c][i][4 * j], 4);
      for (int kk = 0; kk < k; ++kk) {
        const int32_t av = int8_t(g_t.data[a][i][kk]);
        const uint8_t braw = g_t.data[b][kk / 4][4 * j + kk % 4];
        const int32_t bv = int8_t(braw);
        s += uint32_t(av * bv);
      }
      std::memcpy(&g_t.data[c][i][4 * j], &s, 4);
    }
}
#define TILE_CONFIG(cfg) config(cfg)
#define TILE_ZERO(t) zero(t)
#define TILE_LOAD(t, p, s) load(t, p, s)
#define TILE_STORE(t, p, s) store(t, p, s)
#define TILE_DP_SS(c, a, b) dp(c, a, b)
#define TILE_RELEASE() ((void)0)
#include "fk_quant_amx_impl.h"
}  // namespace qamx_emu

// Everything but the a8 micro-kernel is the AVX-512 VNNI path's (forwarded at run time: its table is
// another translation unit's).
namespace {
void mk_w(int fmt, const uint8_t* w, int64_t units, const float* x, int64_t kp, int m, float* acc) {
  kQuantAvx512Ops.mk_w(fmt, w, units, x, kp, m, acc);
}
void quant_row(const uint16_t* x, int64_t k, int64_t kp, int8_t* q, float* d, int32_t* s) {
  kQuantAvx512Ops.quant_row(x, k, kp, q, d, s);
}
void quant_row_f32(const float* x, int64_t k, int64_t kp, int8_t* q, float* d, int32_t* s) {
  kQuantAvx512Ops.quant_row_f32(x, k, kp, q, d, s);
}
void silu_mul(const float* a, const float* b, int64_t n, float* h) { kQuantAvx512Ops.silu_mul_f32(a, b, n, h); }
}  // namespace

extern const QuantOps kQuantAmxOps = {"amx_int8", 16, qamx_hw::qamx_mk_a8, mk_w, quant_row, quant_row_f32, silu_mul};
extern const QuantOps kQuantAmxEmuOps = {"amx_int8_emulated", 16, qamx_emu::qamx_mk_a8, mk_w, quant_row,
                                         quant_row_f32, silu_mul};

}  // namespace fk

#pragma GCC pop_options
#endif  // __x86_64__

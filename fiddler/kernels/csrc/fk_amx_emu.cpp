// Software model of the AMX tile instructions used by fk_amx_impl.h, compiled for the baseline ISA.
// It lets the tests run the AMX path's tiling, strides and padding on any CPU; the arithmetic follows
// TDPBF16PS: per output element, the even then the odd bf16 product of each pair is added in fp32.
#include <cstring>

#include "fk.h"

namespace fk {
namespace {

struct EmuTiles {
  uint8_t rows[8];
  uint16_t colsb[8];
  alignas(64) uint8_t data[8][16][64];
};
thread_local EmuTiles g_t;

struct alignas(64) EmuCfg {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void emu_config(const void* p) {
  const EmuCfg* c = static_cast<const EmuCfg*>(p);
  for (int t = 0; t < 8; ++t) {
    g_t.rows[t] = c->rows[t];
    g_t.colsb[t] = c->colsb[t];
  }
  std::memset(g_t.data, 0, sizeof g_t.data);
}
void emu_zero(int t) { std::memset(g_t.data[t], 0, sizeof g_t.data[t]); }
void emu_load(int t, const void* p, int64_t stride) {
  for (int r = 0; r < g_t.rows[t]; ++r)
    std::memcpy(g_t.data[t][r], static_cast<const char*>(p) + r * stride, g_t.colsb[t]);
}
void emu_store(int t, void* p, int64_t stride) {
  for (int r = 0; r < g_t.rows[t]; ++r)
    std::memcpy(static_cast<char*>(p) + r * stride, g_t.data[t][r], g_t.colsb[t]);
}
void emu_dp(int c, int a, int b) {
  const int m = g_t.rows[c], n = g_t.colsb[c] / 4, kpairs = g_t.colsb[a] / 4;
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      float s;
      std::memcpy(&s, &g_t.data[c][i][4 * j], 4);
      for (int k = 0; k < kpairs; ++k) {
        uint16_t a0, a1, b0, b1;
        std::memcpy(&a0, &g_t.data[a][i][4 * k], 2);
        std::memcpy(&a1, &g_t.data[a][i][4 * k + 2], 2);
        std::memcpy(&b0, &g_t.data[b][k][4 * j], 2);
        std::memcpy(&b1, &g_t.data[b][k][4 * j + 2], 2);
        s += bf16_to_f32(a0) * bf16_to_f32(b0);
        s += bf16_to_f32(a1) * bf16_to_f32(b1);
      }
      std::memcpy(&g_t.data[c][i][4 * j], &s, 4);
    }
}

#define TILE_CONFIG(cfg) emu_config(cfg)
#define TILE_ZERO(t) emu_zero(t)
#define TILE_LOAD(t, p, s) emu_load(t, p, s)
#define TILE_STORE(t, p, s) emu_store(t, p, s)
#define TILE_DP(c, a, b) emu_dp(c, a, b)
#define TILE_RELEASE() ((void)0)
#include "fk_amx_impl.h"

}  // namespace

extern const IsaOps kAmxEmuOps = {"amx_emulated", 32, amx_mk, silu_mul_generic, store_generic,
                                  read_generic, amx_done};

}  // namespace fk

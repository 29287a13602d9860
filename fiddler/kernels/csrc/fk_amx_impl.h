// AMX micro-kernel body, included twice: by fk_amx.cpp with the hardware tile instructions and by
// fk_amx_emu.cpp with a software model of them (so the tiling logic is tested on CPUs without AMX).
// The includer defines TILE_CONFIG(cfg), TILE_ZERO(t), TILE_LOAD(t, ptr, stride_bytes),
// TILE_STORE(t, ptr, stride_bytes), TILE_DP(c, a, b) (tdpbf16ps) and TILE_RELEASE().
//
// Tiles: 0..3 accumulators C[token tile][column tile], 4..5 tokens (A), 6..7 weights (B).
// One call covers m = 16 or 32 tokens (x rows padded by the driver) and the block's 32 rows: an A
// tile is 16 tokens x 32 k, a B tile is 16 kp rows x 16 column pairs taken straight from the packed
// block (row stride 128 bytes), a C tile is 16 tokens x 16 rows in fp32 (acc row stride 128 bytes).

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static void amx_mk(const uint16_t* w, int64_t kpairs, const uint16_t* x, int64_t ldx, int m,
                   float* acc, bool accumulate, const char*, int64_t) {
  TileConfig cfg = {};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  TILE_CONFIG(&cfg);
  const bool two = m > 16;
  const char* wb = reinterpret_cast<const char*>(w);
  const int64_t xs = ldx * 2;  // bytes between token rows
  if (accumulate) {
    TILE_LOAD(0, acc, 128);
    TILE_LOAD(1, acc + 16, 128);
    if (two) {
      TILE_LOAD(2, acc + 16 * 32, 128);
      TILE_LOAD(3, acc + 16 * 32 + 16, 128);
    }
  } else {
    TILE_ZERO(0);
    TILE_ZERO(1);
    TILE_ZERO(2);
    TILE_ZERO(3);
  }
  for (int64_t kp = 0; kp < kpairs; kp += 16) {
    TILE_LOAD(4, x + 2 * kp, xs);
    TILE_LOAD(6, wb + kp * 128, 128);
    TILE_LOAD(7, wb + kp * 128 + 64, 128);
    TILE_DP(0, 4, 6);
    TILE_DP(1, 4, 7);
    if (two) {
      TILE_LOAD(5, x + 16 * ldx + 2 * kp, xs);
      TILE_DP(2, 5, 6);
      TILE_DP(3, 5, 7);
    }
  }
  TILE_STORE(0, acc, 128);
  TILE_STORE(1, acc + 16, 128);
  if (two) {
    TILE_STORE(2, acc + 16 * 32, 128);
    TILE_STORE(3, acc + 16 * 32 + 16, 128);
  }
  TILE_RELEASE();
}

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

// The tile palette is loaded once per thread and region, not per call (LDTILECFG and TILERELEASE cost
// about as much as a few tile products): amx_mk loads it on a thread's first call and the driver calls
// amx_done when the thread's share of the region ends, so no tile state outlives a kernel call (other
// libraries on the same thread, e.g. oneDNN, configure tiles their own way).
thread_local bool t_amx_configured = false;

static void amx_begin() {
  if (t_amx_configured) return;
  TileConfig cfg = {};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  TILE_CONFIG(&cfg);
  t_amx_configured = true;
}

static void amx_done() {
  if (!t_amx_configured) return;
  TILE_RELEASE();
  t_amx_configured = false;
}

// Weights this call reads from DRAM (a lone token group) are prefetched twice per 2 KiB step: into L1
// from kAmxNear bytes ahead (mostly this step's own lines) and into L2 kAmxAhead bytes ahead. The near
// prefetches matter: a tile load keeps few of its 16 line misses in flight, 32 prefetches issued just
// before it keep them all, and the stream ran at 0.78 of vector loads with the L2 prefetch alone (4 KiB
// ahead) against 0.93-0.95 with both (Intel Xeon, family 6 model 167, 2 threads, in-process interleaved:
// results/measured/2026-12-05-intel-xeon-amx-near-prefetch). A call whose weights were pulled earlier
// pulls its share of the next piece (pf, pf_lines), spread over its k steps, so the stream never waits.
#ifndef FK_AMX_NEAR
#define FK_AMX_NEAR 256
#endif
#ifndef FK_AMX_AHEAD
#define FK_AMX_AHEAD 2560
#endif
constexpr int64_t kAmxNear = FK_AMX_NEAR, kAmxAhead = FK_AMX_AHEAD;

static void amx_mk(const uint16_t* w, int64_t kpairs, const uint16_t* x, int64_t ldx, int m,
                   float* acc, bool accumulate, const char* pf, int64_t pf_lines) {
  amx_begin();
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
  const int64_t steps = kpairs / 16;
  const bool streaming = pf_lines <= 0;
  const int64_t per = streaming ? 0 : (pf_lines + steps - 1) / steps;
  for (int64_t kp = 0; kp < kpairs; kp += 16) {
    if (streaming) {
      const char* near = wb + kp * 128 + kAmxNear;
      const char* ahead = wb + kp * 128 + kAmxAhead;
      for (int l = 0; l < 32; ++l) __builtin_prefetch(near + 64 * l, 0, 3);
      for (int l = 0; l < 32; ++l) __builtin_prefetch(ahead + 64 * l, 0, 2);
    } else {
      const int64_t n = per < pf_lines ? per : pf_lines;
      for (int64_t l = 0; l < n; ++l) __builtin_prefetch(pf + 64 * l, 0, 2);
      pf += 64 * n;
      pf_lines -= n;
    }
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
}

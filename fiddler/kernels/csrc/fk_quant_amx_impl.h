// AMX-INT8 micro-kernel of the a8 mode, included twice by fk_quant_amx.cpp: with the hardware tile
// instructions and with a software model of them (so the tiling is tested on CPUs without AMX). The
// includer defines TILE_CONFIG(cfg), TILE_ZERO(t), TILE_LOAD(t, ptr, stride_bytes),
// TILE_STORE(t, ptr, stride_bytes), TILE_DP_SS(c, a, b) (tdpbssd: signed x signed bytes) and
// TILE_RELEASE(), which this file undefines at its end; the fp32 side is AVX-512.
//
// Why: at 16 tokens the AVX-512 a8 kernel issues 8 vpdpbusd per token and block, and is compute-bound
// at about a third of the read limit on a Mixtral-8x7B expert. One tile product does a block's 16
// tokens x 16 rows x 32 k at once; what is left on the vector units is each block's per-token scaling.
//
// Per 32-block of K (a tile product per block: each block has its own scales):
//   A (tiles 4, 5): the block's m tokens' int8 quants, straight from the block-major a8 layout (32 bytes a
//     token, fk_quant.h);
//   B (tiles 6, 7): the block's 16 rows as signed bytes in VNNI order, which is the packed layout's
//     (4-byte column j of each row = k 4j..4j+3), written to an L1 ring a few units ahead (below): Q8_0
//     the stored q + 128 with the sign bit flipped back (q); Q4_0 the nibbles minus 8 (rows 0..3 the low
//     nibbles = k 0..15, rows 4..7 the high ones = k 16..31);
//   C (tiles 0..3): the int32 dot products [token][row], two units in flight.
// The int32 sums are exact, as vpdpbusd's (which the vector path corrects by 128 x the activations' sum
// for its unsigned operand: the same integer); the fp32 steps after them are the vector path's, in its
// order (per token: block after block, s = float(isum), f = fma(s, d_w * d_x, f)), so every output has
// the same bits on either path and a row is the same alone or among any tokens.

struct alignas(64) QTileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// A unit's two blocks as signed bytes in VNNI order, for a tile load kRingLag units later. A tile load
// does not take data from the store buffer: loading the rows just written stalls until the stores reach
// L1 (the tile path ran 0.26-0.9x the vector one at 1-16 tokens that way, Intel Xeon family 6 model 207),
// so units are converted kRingLag ahead into a ring. Q8_0 goes through the ring too: flipping its sign
// bits costs one xor per 64 bytes, where multiplying the unsigned bytes as stored (tdpbsud) costs the
// zero-point correction, an integer multiply and subtract per token and block (Q8_0 at 16 tokens: 0.77x
// the time per block in L2, same host).
constexpr int kRingLag = 2, kRingSlots = 4;
template <int Fmt>
inline void ring_unit(const uint8_t* w, int8_t (*bq)[8][64]) {
  if constexpr (Fmt == kQ8_0) {
    const __m512i sign = _mm512_set1_epi8(char(0x80));
    for (int b = 0; b < 2; ++b)
      for (int j = 0; j < 8; ++j)
        _mm512_store_si512(bq[b][j], _mm512_xor_si512(_mm512_load_si512(w + 64 + b * 512 + 64 * j), sign));
  } else {
    const __m512i low = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi8(8);
    for (int b = 0; b < 2; ++b)
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_load_si512(w + 64 + b * 256 + 64 * j);
        _mm512_store_si512(bq[b][j], _mm512_sub_epi8(_mm512_and_si512(v, low), eight));
        _mm512_store_si512(bq[b][4 + j], _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), eight));
      }
  }
}

// One block's tile product into C tile `c` (A tile `a`, B tile `bt`: literal numbers, which the tile
// intrinsics need).
#define QAMX_BLOCK(c, a, bt, b)                         \
  do {                                                  \
    TILE_ZERO(c);                                       \
    TILE_LOAD(a, xq + (kb0 + (b)) * ld * kQK, kQK);     \
    TILE_LOAD(bt, bq[b], 64);                           \
    TILE_DP_SS(c, a, bt);                               \
  } while (0)

// The unit's tile products: C tiles 0, 1 (even units) or 2, 3 (odd ones) for its two blocks, both
// issued before either is stored to cbuf; the B rows come from the ring (bq).
template <bool Odd>
inline void qamx_unit_tiles(const int8_t* xq, int64_t ld, int64_t kb0, int32_t (*cbuf)[16][16],
                            const int8_t (*bq)[8][64]) {
  if constexpr (Odd) {
    QAMX_BLOCK(2, 4, 6, 0);
    QAMX_BLOCK(3, 5, 7, 1);
    TILE_STORE(2, cbuf[0], 64);
    TILE_STORE(3, cbuf[1], 64);
  } else {
    QAMX_BLOCK(0, 4, 6, 0);
    QAMX_BLOCK(1, 5, 7, 1);
    TILE_STORE(0, cbuf[0], 64);
    TILE_STORE(1, cbuf[1], 64);
  }
}
#undef QAMX_BLOCK

// The unit's fp32 side: f[t] += float(isum[t]) * (d_w * d_x[t]) for its two blocks.
template <int M>
inline void qamx_unit_scale(const uint8_t* w, const float* xd, int64_t ld, int64_t kb0, const int32_t (*cbuf)[16][16],
                            __m512* f) {
  for (int b = 0; b < 2; ++b) {
    const __m512 dw = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(w + 32 * b)));
    const float* db = xd + (kb0 + b) * ld;
    for (int t = 0; t < M; ++t)
      f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cbuf[b][t])), _mm512_mul_ps(dw, _mm512_set1_ps(db[t])),
                             f[t]);
  }
}

// acc[t][16] for tokens t < M of the row group's stream w (`units` units; xs, the activations' sums, is
// the vector path's and unused here). The tiles of unit u are
// issued before the fp32 side of unit u - 1, so the tile products run while the vector units scale.
// The stream is prefetched as the vector path does (per line, the per-CPU near and far distances).
template <int Fmt, int M>
void qamx_mk_t(const uint8_t* w, int64_t units, const int8_t* xq, const float* xd, const int32_t* /*xs*/, int64_t ld,
               float* acc, int64_t near, int64_t far) {
  constexpr int64_t ub = Fmt == kQ8_0 ? 1088 : 576;
  QTileConfig cfg = {};
  cfg.palette = 1;
  for (int t = 0; t < 4; ++t) {  // C: M tokens x 16 int32
    cfg.rows[t] = M;
    cfg.colsb[t] = 64;
  }
  for (int t = 4; t < 6; ++t) {  // A: M tokens x 32 int8
    cfg.rows[t] = M;
    cfg.colsb[t] = kQK;
  }
  for (int t = 6; t < 8; ++t) {  // B: 8 rows of 4 k x 16 rows
    cfg.rows[t] = 8;
    cfg.colsb[t] = 64;
  }
  TILE_CONFIG(&cfg);
  alignas(64) int32_t cbuf[2][2][16][16];
  alignas(64) int8_t bq[kRingSlots][2][8][64];
  __m512 f[M];
  for (int t = 0; t < M; ++t) f[t] = _mm512_setzero_ps();
  for (int64_t v = 0; v < kRingLag && v < units; ++v) ring_unit<Fmt>(w + v * ub, bq[v % kRingSlots]);
  for (int64_t u = 0; u <= units; ++u) {
    const uint8_t* wu = w + u * ub;
    if (u < units) {
      for (int64_t l = 0; l < ub; l += 64) {
        if (near) _mm_prefetch(reinterpret_cast<const char*>(wu + l + near), _MM_HINT_T0);
        if (far) _mm_prefetch(reinterpret_cast<const char*>(wu + l + far), _MM_HINT_T1);
      }
      if (u + kRingLag < units) ring_unit<Fmt>(wu + kRingLag * ub, bq[(u + kRingLag) % kRingSlots]);
      const auto* bu = bq[u % kRingSlots];
      if (u & 1) qamx_unit_tiles<true>(xq, ld, 2 * u, cbuf[1], bu);
      else qamx_unit_tiles<false>(xq, ld, 2 * u, cbuf[0], bu);
    }
    if (u > 0) qamx_unit_scale<M>(wu - ub, xd, ld, 2 * (u - 1), cbuf[(u - 1) & 1], f);
  }
  TILE_RELEASE();
  for (int t = 0; t < M; ++t) _mm512_storeu_ps(acc + t * kQRows, f[t]);
}

using QAmxFn = void (*)(const uint8_t*, int64_t, const int8_t*, const float*, const int32_t*, int64_t, float*,
                        int64_t, int64_t);
template <int Fmt>
constexpr QAmxFn kQAmx[16] = {qamx_mk_t<Fmt, 1>,  qamx_mk_t<Fmt, 2>,  qamx_mk_t<Fmt, 3>,  qamx_mk_t<Fmt, 4>,
                              qamx_mk_t<Fmt, 5>,  qamx_mk_t<Fmt, 6>,  qamx_mk_t<Fmt, 7>,  qamx_mk_t<Fmt, 8>,
                              qamx_mk_t<Fmt, 9>,  qamx_mk_t<Fmt, 10>, qamx_mk_t<Fmt, 11>, qamx_mk_t<Fmt, 12>,
                              qamx_mk_t<Fmt, 13>, qamx_mk_t<Fmt, 14>, qamx_mk_t<Fmt, 15>, qamx_mk_t<Fmt, 16>};

// QuantOps::mk_a8 of this path: tile products from qamx_min_tokens(fmt) tokens, the AVX-512 kernel below.
void qamx_mk_a8(int fmt, const uint8_t* w, int64_t units, const int8_t* xq, const float* xd, const int32_t* xs,
                int64_t ld, int m, float* acc) {
  if (m < qamx_min_tokens(fmt)) return kQuantAvx512Ops.mk_a8(fmt, w, units, xq, xd, xs, ld, m, acc);
  const StreamTuning st = stream_tuning();
  const int64_t near = st.hint != kHintNone ? st.distance : 0;
  (fmt == kQ8_0 ? kQAmx<kQ8_0> : kQAmx<kQ4_0>)[m - 1](w, units, xq, xd, xs, ld, acc, near, st.far);
}

// the includer's tile macros end here, so that it can include this file again with others
#undef TILE_CONFIG
#undef TILE_ZERO
#undef TILE_LOAD
#undef TILE_STORE
#undef TILE_DP_SS
#undef TILE_RELEASE

// Quantized weights: llama.cpp's Q8_0 and Q4_0 blocks, re-arranged for the vector paths.
//
// The values are exactly llama.cpp's (ggml's block_q8_0 / block_q4_0): blocks of 32 consecutive
// weights of one row with an fp16 scale d; Q8_0 stores 32 int8 q (w = q * d), Q4_0 stores 16 bytes
// whose low nibbles are weights 0..15 and high nibbles weights 16..31 (w = (nibble - 8) * d). Packing
// only moves those bytes (fk_qpack); unpacking them gives back the GGUF bytes bit for bit.
//
// Packed layout: rows are cut into groups of kQRows = 16 (one 32-bit lane per row in a zmm register);
// K is padded to a multiple of 64 (two blocks). For each row group, for each pair of K blocks
// (kb = 2p, 2p+1) one "unit":
//   64 bytes   the 2 x 16 fp16 scales d[kb][row]
//   then for each of the 2 blocks the quants in 4-byte columns: for j in 0..J-1, for row in 0..15,
//   4 bytes = the block's bytes 4j..4j+3 (Q8_0: J = 8, the int8 q of weights 4j..4j+3 stored as the
//   unsigned q + 128, i.e. with the sign bit flipped, the operand vpdpbusd takes as is;
//   Q4_0: J = 4, qs bytes 4j..4j+3 = weights 4j..4j+3 in the low and 16+4j..16+4j+3 in the high nibbles).
// Units are 1088 (Q8_0) and 576 (Q4_0) bytes, multiples of 64, so a row group is one aligned stream;
// rows past N and blocks past K have d = 0 and q = 0. `groups` matrices of one shape (W1, W3) are
// interleaved per row group, as for bf16.
//
// Two ways to compute (fk_set_qmode):
//  - "a8": activations quantized to Q8_0 per 32-block, as llama.cpp does on x86 (fp16 scale, q =
//    round(x / d), d = amax / 127), then integer dot products (vpdpbusd with AVX512-VNNI, pmaddubsw
//    with AVX2) and one fp32 multiply-add per block: sum_kb d_w d_x sum_i q_w q_x.
//  - "w": weight-only; activations stay fp32 (from bf16), weights are dequantized in registers,
//    fp32 products and sums, one multiply by d_w per block.
#pragma once
#include <cstdint>

#include "fk.h"

namespace fk {

enum QFormat { kQ8_0 = 0, kQ4_0 = 1, kNumQFormats = 2 };
enum QMode { kQModeA8 = 0, kQModeW = 1 };

constexpr int kQK = 32;       // weights per block
constexpr int kQRows = 16;    // rows per packed row group
constexpr int kQAlignK = 64;  // K padding (two blocks per unit)

inline int64_t q_block_bytes(int fmt) { return fmt == kQ8_0 ? 34 : 18; }        // llama.cpp's block
inline int64_t q_quant_bytes(int fmt) { return fmt == kQ8_0 ? 512 : 256; }      // one block of a row group
inline int64_t q_unit_bytes(int fmt) { return 64 + 2 * q_quant_bytes(fmt); }    // two blocks of a row group
// The zero point of the unsigned bytes the vector paths multiply: Q8_0 stores q + 128, Q4_0 the nibble q + 8.
inline int32_t q_zero(int fmt) { return fmt == kQ8_0 ? 128 : 8; }

// fp16 <-> fp32 (IEEE half, round to nearest even), portable.
inline float half_to_f32(uint16_t h) {
  const uint32_t s = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu;
  uint32_t u;
  if (e == 0) {
    if (m == 0) u = s;
    else {  // subnormal
      float f = float(m) * (1.0f / 16777216.0f);
      __builtin_memcpy(&u, &f, 4);
      u |= s;
    }
  } else if (e == 31) u = s | 0x7f800000u | (m << 13);
  else u = s | ((e + 112) << 23) | (m << 13);
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
uint16_t f32_to_half(float f);

// The a8 activation layout, block-major: for each 32-block kb of K, every token's Q8_0 quants of x,
// its scale (fp16-rounded, as fp32) and the zero-point correction of the unsigned weight operand,
// -q_zero(fmt) * (the sum of its quants), which a vpdpbusd sum starts from (so it depends on the format
// of the weights the activations meet):
//   q [kp / 32][ld][32] int8,  d [kp / 32][ld] fp32,  s [kp / 32][ld] int32   (ld: the call's tokens)
// A micro-kernel then finds token t of a block at a fixed offset from one pointer (t * 32 bytes, t * 4)
// however many tokens it takes, which keeps 16 tokens' addresses out of the general registers.

// One ISA path's quantized micro-kernels. Both compute, for tokens t < m of a token group and the 16
// rows of one row group, acc[t][16] = sum over the `units` units of the row group's stream w.
struct QuantOps {
  const char* name;
  int mr;  // tokens per call
  // a8: xq/xd/xs (the a8 layout, `ld` tokens a block) already offset to the token group's first token
  void (*mk_a8)(int fmt, const uint8_t* w, int64_t units, const int8_t* xq, const float* xd,
                const int32_t* xs, int64_t ld, int m, float* acc);
  // w: x fp32 [m][kp]
  void (*mk_w)(int fmt, const uint8_t* w, int64_t units, const float* x, int64_t kp, int m, float* acc);
  // a8 activations of one bf16 row x[k] (zero-padded to kp): q[kp], d[kp/32], s[kp/32] (one token's row);
  // every path gives the same bits (exact max, IEEE divide and multiply, round-half-even)
  void (*quant_row)(const uint16_t* x, int64_t k, int64_t kp, int8_t* q, float* d, int32_t* s);
  // the same for an fp32 row (an expert's hidden activations, which stay fp32 as in llama.cpp)
  void (*quant_row_f32)(const float* x, int64_t k, int64_t kp, int8_t* q, float* d, int32_t* s);
  // h[i] = silu(a[i]) * b[i] in fp32, i < n
  void (*silu_mul_f32)(const float* a, const float* b, int64_t n, float* h);
};
void quant_row_generic(const uint16_t* x, int64_t k, int64_t kp, int8_t* q, float* d, int32_t* s);
void quant_row_f32_generic(const float* x, int64_t k, int64_t kp, int8_t* q, float* d, int32_t* s);
void silu_mul_f32_generic(const float* a, const float* b, int64_t n, float* h);

extern const QuantOps kQuantGenericOps;
#if defined(__x86_64__)
extern const QuantOps kQuantAvx2Ops;    // needs avx2, fma, f16c
extern const QuantOps kQuantAvx512Ops;  // needs avx512f/bw/vl + avx512_vnni
// The AVX-512 VNNI path with AMX-INT8 tile products from qamx_min_tokens() tokens (a8 mode), on real
// tiles (needs amx_tile + amx_int8 and the tile-data permission) or a software model of them.
extern const QuantOps kQuantAmxOps;
extern const QuantOps kQuantAmxEmuOps;
#endif

// ---------------------------------------------------------------- drivers (fk_quant.cpp)
int64_t qpacked_bytes(int fmt, int64_t n, int64_t k, int groups);  // -1 for bad arguments
// Packs `groups` matrices given as llama.cpp blocks, row-major: src[g] holds n rows of k/32 blocks
// (k a multiple of 32).
int qpack(int fmt, const uint8_t* const* src, int groups, int64_t n, int64_t k, void* dst, int threads);
// The inverse: llama.cpp blocks of one matrix (group g) back from the packed buffer.
int qunpack(int fmt, const void* packed, int groups, int g, int64_t n, int64_t k, uint8_t* dst);
// x: bf16 rows, or fp32 rows when x_f32 (quantized from fp32 as llama.cpp quantizes its fp32 activations).
int qlinear(int fmt, const void* packed, int64_t n, int64_t k, const void* x, bool x_f32, int64_t tokens,
            const float* bias, void* y, bool out_f32, int threads);
int qexpert_ffn(int fmt, const void* p13, const void* p2, int64_t hidden, int64_t ffn, const void* x, bool x_f32,
                int64_t tokens, uint16_t* y, int threads);
int qmoe_ffn(int fmt, const void* const* p13, const void* const* p2, const uint16_t* w, int n_experts,
             int64_t hidden, int64_t ffn, const void* x, bool x_f32, int64_t tokens, uint16_t* y, int threads);
// Round-to-nearest quantization of fp32 rows [n][k] (k a multiple of 32) into llama.cpp blocks, the
// arithmetic of ggml's quantize_row_q8_0_ref / quantize_row_q4_0_ref.
int quantize_rows(int fmt, const float* x, int64_t n, int64_t k, uint8_t* dst, int threads);

// mode and path: -1 = auto (the per-CPU default); returns 0 or fail()
int set_qmode(int mode, int isa);
int qmode();
int qisa();  // the ISA code (fk_internal.h Isa) of the active quantized path
const char* qmode_source();
// AMX-INT8 tiles for the a8 mode on the AVX-512 path (AmxMode of fk_internal.h: -1 = auto, i.e. on where
// the CPU has them and the self-check agrees; 0 off, 1 the tiles, 2 the software model) from
// min_tokens[fmt] tokens a row-group call (null or <= 0: the default; kQAmxNever: never); returns 0 or
// fail(). qamx() is the mode in effect: off unless the active path is AVX-512 VNNI in a8 mode.
constexpr int kQAmxNever = 17;  // a row-group call takes at most 16 tokens
int set_qamx(int amx, const int* min_tokens);
int qamx();
int qamx_min_tokens(int fmt);
const char* qamx_status();
// Tokens a pass of the AVX-512 VNNI a8 micro-kernel at 9-16 tokens a call (8 or 16; the per-vendor table of
// fk_tuning.cpp on first use); set_qpass(0, ...) goes back to the table. 0 or an error (fail).
int qpass();
int set_qpass(int tokens, const char* source);
const char* qpass_source();  // valid until the next set_qpass

}  // namespace fk

// Shared declarations of the Fiddler CPU kernel library.
//
// Packed weight layout (one layout for every ISA path, so an expert is packed once):
// a matrix W[N][K] (Hugging Face nn.Linear layout, bf16) is cut into blocks of kBlockN = 32 rows;
// inside a block, for each pair of columns kp (k = 2kp, 2kp+1) the 32 rows store their two values
// next to each other:  block[kp][n][e] = W[nb*32 + n][2*kp + e], zero outside the matrix.
// So a block is one contiguous stream, a 128-byte kp row is two vdpbf16ps operands (16 rows x one
// column pair each), and 16 kp rows x 64 bytes is an AMX B tile (row stride 128).
// `groups` matrices with the same shape (W1 and W3 of an expert) are interleaved block by block:
// packed[nb][g] so that the fused gate/up pass reads a single stream.
// K is padded to a multiple of kAlignK (the AMX tile depth), N to a multiple of kBlockN.
// 32 rows (not 64) because 2 weight registers leave room for 12 tokens' accumulators: up to 12
// tokens stream the weights in a single pass.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fk {

constexpr int kBlockN = 32;        // rows per packed block
constexpr int kAlignK = 32;        // K padding (one AMX tile = 32 bf16 of depth)
constexpr int64_t kChunkK = 4096;  // K chunk: a 32 x 4096 bf16 weight piece (256 KiB) stays in L2
                                   // while it is reused by every token group

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
inline int64_t block_bytes(int64_t k_pad) { return k_pad * kBlockN * 2; }  // one packed block

// Scalar bf16 helpers (round to nearest even, NaN kept quiet), usable by every path.
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// How a vector path streams weights that it reads once from DRAM (a 1..12-token group): a software
// prefetch `distance` bytes ahead with a hint (or none), plus optionally a second one into L2 (T1)
// `far` bytes ahead, which keeps more lines in flight than the L1 fill buffers allow. The best choice
// differs between CPUs (on an Intel Xeon NTA halved the rate that T0 reached; on an AMD Zen 5 NTA was
// slightly faster), so it is chosen on the machine at run time (fk_tuning.cpp) and can be overridden.
enum StreamHint { kHintNone = 0, kHintT0 = 1, kHintT1 = 2, kHintNta = 3, kNumHints = 4 };
extern const char* const kHintNames[kNumHints];
struct StreamTuning {
  int hint;
  int64_t distance;  // bytes, a multiple of 64
  int64_t far;       // bytes ahead of the second (T1) prefetch, a multiple of 64; 0: none
};
StreamTuning stream_tuning();  // the active choice (cheap: relaxed atomic loads)

template <int Hint>
inline void prefetch(const void* p) {
  if constexpr (Hint == kHintT0) __builtin_prefetch(p, 0, 3);
  else if constexpr (Hint == kHintT1) __builtin_prefetch(p, 0, 2);
  else if constexpr (Hint == kHintNta) __builtin_prefetch(p, 0, 0);
}

// The stream prefetches of one 128-byte step of a weight stream at wp: `Hint` `dist` bytes ahead and
// into L2 `far` bytes ahead (0: none). Shared by the vector paths' micro-kernels.
template <int Hint>
inline void prefetch_stream_step(const char* wp, int64_t dist, int64_t far) {
  if constexpr (Hint != kHintNone) {
    prefetch<Hint>(wp + dist);
    prefetch<Hint>(wp + dist + 64);
  }
  if (far) {
    prefetch<kHintT1>(wp + far);
    prefetch<kHintT1>(wp + far + 64);
  }
}

// A micro-kernel's prefetch for one 128-byte kp step at wp: where the call streams its chunk from DRAM (one token
// group: `streaming`), the stream prefetches above; else the chunk was pulled in by the previous chunk's calls and
// this call pulls its share of the next chunk, `per` lines a step from pf into L1 (pf and pf_lines advance).
template <int Hint>
inline void prefetch_kernel_step(const char* wp, bool streaming, int64_t dist, int64_t far, const char*& pf,
                                 int64_t& pf_lines, int64_t per) {
  if (streaming) {
    prefetch_stream_step<Hint>(wp, dist, far);
  } else if (pf_lines > 0) {
    for (int64_t i = 0; i < per; ++i) prefetch<kHintT0>(pf + 64 * i);
    pf += 64 * per;
    pf_lines -= per;
  }
}

// One ISA path. The driver (fk_api.cpp) does blocking, threading and padding; a path supplies:
struct IsaOps {
  const char* name;
  int mr;  // tokens per micro-kernel call (the AMX path needs multiples of 16 with padded rows)
  // acc[m][32] (+)= sum_{kp < kpairs} w[kp][n][0..1] . x[m][2kp..2kp+1]   for m < mr_used
  // w: packed block, already offset to the first kp; x row stride ldx elements; acc row stride 32.
  // pf/pf_lines: cache lines (64 B) to pull into L2 along the way (the next weight chunk, while this
  // one is reused from L2 by later token groups); paths may ignore it.
  void (*mk)(const uint16_t* w, int64_t kpairs, const uint16_t* x, int64_t ldx, int m,
             float* acc, bool accumulate, const char* pf, int64_t pf_lines);
  // h[i] = bf16(silu(a[i]) * b[i]) for i < n
  void (*silu_mul)(const float* a, const float* b, int64_t n, uint16_t* h);
  // y[i] = acc[i] (+ bias[i]) as bf16 or fp32, i < n; bias may be null
  void (*store)(const float* acc, const float* bias, int64_t n, void* y, bool out_f32);
  // reads n bytes (n multiple of 256, p 64-byte aligned) with the widest loads, prefetching with
  // `hint` (StreamHint) `dist` bytes ahead; returns a checksum. The bandwidth probe's read.
  uint64_t (*read)(const void* p, int64_t n, int hint, int64_t dist);
  // called on a thread when its share of a region ends (after its last mk call): releases per-thread
  // state such as the AMX tile configuration; null where a path keeps none
  void (*done)();
  // Optional (null: the driver uses mk): two blocks at once, the same x rows (m <= mr2) against the
  // kp rows of wa and of wb, into acc_a and acc_b (each as mk's acc), and pf_lines lines of each of pfa
  // and pfb (either may be null) pulled into cache along the way. Each output's sum runs in mk's order,
  // so the bits are mk's. Where a broadcast of x costs issue slots of the dot-product pipes (AMD Zen 4:
  // vdpbf16ps on 512 bits is double-pumped), 64 rows per broadcast instead of 32 halve that cost.
  int mr2;
  void (*mk2)(const uint16_t* wa, const uint16_t* wb, int64_t kpairs, const uint16_t* x, int64_t ldx, int m,
              float* acc_a, float* acc_b, bool accumulate, const char* pfa, const char* pfb, int64_t pf_lines);
};

extern const IsaOps kGenericOps;
// the portable pieces, reused by paths that only replace the micro-kernel
void silu_mul_generic(const float* a, const float* b, int64_t n, uint16_t* h);
void store_generic(const float* acc, const float* bias, int64_t n, void* y, bool out_f32);
uint64_t read_generic(const void* p, int64_t n, int hint, int64_t dist);
#if defined(__x86_64__)
// the AVX2 epilogues, reused by the AVX-512 F path (same bits as the portable ones)
void silu_mul_avx2(const float* a, const float* b, int64_t n, uint16_t* h);
void store_avx2(const float* acc, const float* bias, int64_t n, void* y, bool out_f32);
// the probe's read on zmm (AVX-512 F), shared by every AVX-512 path
uint64_t read_avx512(const void* p, int64_t n, int hint, int64_t dist);
// the AVX512-BF16 epilogues, reused by the AMX path
void silu_mul_avx512_bf16(const float* a, const float* b, int64_t n, uint16_t* h);
void silu_mul_f32_avx512(const float* a, const float* b, int64_t n, float* h);  // h kept fp32 (quantized path)
void store_avx512_bf16(const float* acc, const float* bias, int64_t n, void* y, bool out_f32);
extern const IsaOps kAvx2Ops;
extern const IsaOps kAvx512FOps;   // AVX-512 F without BF16: bf16 widened to fp32, FMA on zmm
extern const IsaOps kAvx512Ops;
extern const IsaOps kAmxOps;       // real AMX tiles
// ldtilecfg of a 64-byte tile configuration. GCC's _tile_loadconfig declares a read of only its first 8
// bytes, so the compiler may drop the stores that fill in the rest (rows, colsb) as dead, and the
// next tile instruction faults (#UD) or runs on stale shapes; this operand covers all 64.
struct alignas(64) TileConfigBytes {
  unsigned char b[64];
};
inline void load_tile_config(const void* cfg) {
  __asm__ volatile("ldtilecfg %0" ::"m"(*static_cast<const TileConfigBytes*>(cfg)));
}
#endif
extern const IsaOps kAmxEmuOps;    // the same AMX driver code on software tiles (tests its logic)

// fn(ctx, begin, end) over disjoint ranges covering [0, items) on the kernel's thread pool
// (fk_api.cpp); threads <= 0: the library's default thread count.
void parallel_for(int threads, int64_t items, void (*fn)(const void* ctx, int64_t begin, int64_t end),
                  const void* ctx);

}  // namespace fk

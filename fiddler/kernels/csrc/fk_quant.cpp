// Quantized (Q8_0 / Q4_0) weights: quantization, packing, the portable micro-kernels, the run-time
// choice of path and mode, and the blocked drivers (linear, expert FFN, a decode step's MoE block).
// Layout and modes: fk_quant.h.
#include "fk_quant.h"

#include <cmath>
#include <cstring>

#include "fk_internal.h"

namespace fk {

uint16_t f32_to_half(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  const uint32_t s = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(s | 0x7e00u);      // NaN
  if (a >= 0x477ff000u) return uint16_t(s | 0x7c00u);     // rounds to >= 65520: inf
  if (a < 0x38800000u) {                                   // below the smallest normal: subnormal
    float fa;
    __builtin_memcpy(&fa, &a, 4);
    // fa * 2^24 rounded to nearest even is the subnormal's mantissa (nearbyint: current mode = RNE)
    return uint16_t(s | uint32_t(std::nearbyint(fa * 16777216.0f)));
  }
  const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);       // round the 13 dropped bits to nearest even
  return uint16_t(s | ((r - (112u << 23)) >> 13));
}

namespace {

// ---------------------------------------------------------------- portable micro-kernels
// The 4-byte column j of row r in block b of a unit.
inline const uint8_t* qcol(int fmt, const uint8_t* unit, int b, int j, int r) {
  return unit + 64 + b * q_quant_bytes(fmt) + (j * kQRows + r) * 4;
}
inline float unit_scale(const uint8_t* unit, int b, int r) {
  uint16_t h;
  std::memcpy(&h, unit + b * 32 + r * 2, 2);
  return half_to_f32(h);
}
// weights i = 0..31 of row r, block b (the integer q, Q4_0 minus 8)
inline void block_q(int fmt, const uint8_t* unit, int b, int r, int32_t* q) {
  if (fmt == kQ8_0) {
    for (int j = 0; j < 8; ++j)
      for (int c = 0; c < 4; ++c) q[4 * j + c] = int32_t(qcol(fmt, unit, b, j, r)[c]) - 128;
  } else {
    for (int j = 0; j < 4; ++j)
      for (int c = 0; c < 4; ++c) {
        const uint8_t v = qcol(fmt, unit, b, j, r)[c];
        q[4 * j + c] = int32_t(v & 15) - 8;
        q[16 + 4 * j + c] = int32_t(v >> 4) - 8;
      }
  }
}

void mk_a8_generic(int fmt, const uint8_t* w, int64_t units, const int8_t* xq, const float* xd,
                   const int32_t* xs, int64_t ld, int m, float* acc) {
  (void)xs;
  for (int t = 0; t < m; ++t)
    for (int r = 0; r < kQRows; ++r) acc[t * kQRows + r] = 0.0f;
  int32_t q[kQK];
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* unit = w + u * q_unit_bytes(fmt);
    for (int b = 0; b < 2; ++b) {
      const int64_t kb = 2 * u + b;
      for (int r = 0; r < kQRows; ++r) {
        block_q(fmt, unit, b, r, q);
        const float dw = unit_scale(unit, b, r);
        for (int t = 0; t < m; ++t) {
          const int8_t* xb = xq + (kb * ld + t) * kQK;
          int32_t s = 0;
          for (int i = 0; i < kQK; ++i) s += q[i] * int32_t(xb[i]);
          acc[t * kQRows + r] += float(s) * (dw * xd[kb * ld + t]);
        }
      }
    }
  }
}

void mk_w_generic(int fmt, const uint8_t* w, int64_t units, const float* x, int64_t kp, int m, float* acc) {
  for (int t = 0; t < m; ++t)
    for (int r = 0; r < kQRows; ++r) acc[t * kQRows + r] = 0.0f;
  int32_t q[kQK];
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* unit = w + u * q_unit_bytes(fmt);
    for (int b = 0; b < 2; ++b) {
      const int64_t k0 = (2 * u + b) * kQK;
      for (int r = 0; r < kQRows; ++r) {
        block_q(fmt, unit, b, r, q);
        const float dw = unit_scale(unit, b, r);
        for (int t = 0; t < m; ++t) {
          const float* xb = x + t * kp + k0;
          float s = 0.0f;
          for (int i = 0; i < kQK; ++i) s += float(q[i]) * xb[i];
          acc[t * kQRows + r] += s * dw;
        }
      }
    }
  }
}

}  // namespace

namespace {
inline float as_f32(uint16_t v) { return bf16_to_f32(v); }
inline float as_f32(float v) { return v; }

template <class T>
void quant_row_t(const T* x, int64_t k, int64_t kp, int8_t* q, float* d, int32_t* s) {
  float v[kQK];
  for (int64_t kb = 0; kb < kp / kQK; ++kb) {
    float amax = 0.0f;
    for (int i = 0; i < kQK; ++i) {
      const int64_t c = kb * kQK + i;
      v[i] = c < k ? as_f32(x[c]) : 0.0f;
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    d[kb] = half_to_f32(f32_to_half(amax / 127.0f));
    int32_t sum = 0;
    for (int i = 0; i < kQK; ++i) {
      const int qi = int(std::nearbyint(v[i] * id));
      q[kb * kQK + i] = int8_t(qi);
      sum += qi;
    }
    s[kb] = sum;
  }
}
}  // namespace

void quant_row_generic(const uint16_t* x, int64_t k, int64_t kp, int8_t* q, float* d, int32_t* s) {
  quant_row_t(x, k, kp, q, d, s);
}
void quant_row_f32_generic(const float* x, int64_t k, int64_t kp, int8_t* q, float* d, int32_t* s) {
  quant_row_t(x, k, kp, q, d, s);
}
void silu_mul_f32_generic(const float* a, const float* b, int64_t n, float* h) {
  for (int64_t i = 0; i < n; ++i) h[i] = a[i] / (1.0f + std::exp(-a[i])) * b[i];
}

extern const QuantOps kQuantGenericOps = {"generic", 4, mk_a8_generic, mk_w_generic, quant_row_generic,
                                          quant_row_f32_generic, silu_mul_f32_generic};

// ---------------------------------------------------------------- mode and path
namespace {
std::atomic<int> g_qmode{-1};
std::atomic<int> g_qisa{-1};
const char* g_qsource = "default";
std::atomic<int> g_qamx{-1};
// From this many tokens a row-group call takes the tile kernel (fk_quant_amx_impl.h), below it the
// AVX-512 one (kQAmxNever: never); both give the same bits, so the crossover is a speed choice only. On
// a Mixtral-8x7B expert streamed from DRAM (Intel Xeon, family 6 model 207, 2 threads, interleaved) the
// tiles ran Q4_0 at 0.69x the vector kernel's speed at 4 tokens, 1.02x at 8 and 1.11-1.34x at 10-16,
// and Q8_0 at 0.79x at 4, 0.89-0.99x at 8-14 and 1.10x at 16 (1.15-1.31x at 16, 0.80-0.89x at 8-14 once
// its B tiles went through the ring, 2026-12-05): each block's per-token fp32 scaling is
// left on the vector units, and a Q8_0 block is twice the bytes to hide it behind. quant.tune_amx
// measures it per machine.
constexpr int kDefaultQAmxMinTokens[kNumQFormats] = {16, 8};  // Q8_0, Q4_0
std::atomic<int> g_qamx_min_tokens[kNumQFormats] = {{kDefaultQAmxMinTokens[0]}, {kDefaultQAmxMinTokens[1]}};
const char* g_qamx_status = "not checked";

bool has_avx2_quant() { return cpu().avx2() && cpu().has[kF16c]; }
bool has_avx512_quant() {
  const Cpu& c = cpu();
  return c.has[kAvx512f] && c.has[kAvx512bw] && c.has[kAvx512vl] && c.has[kAvx512vnni] && c.has[kOsAvx512] &&
         c.has[kF16c];
}
int best_qisa() {
#if defined(__x86_64__)
  if (has_avx512_quant()) return kIsaAvx512F;
  if (has_avx2_quant()) return kIsaAvx2;
#endif
  return kIsaGeneric;
}
// The per-CPU default mode: a8 wherever an integer dot product exists (measured on an Intel Xeon
// with Sapphire Rapids flags, 2 threads, small_mixtral's expert shapes at 1 token: see
// scripts/bench_quant.py and fiddler/kernels/API.md); the portable path defaults to w (exact
// products, and no faster either way).
int default_qmode(int isa) { return isa == kIsaGeneric ? kQModeW : kQModeA8; }

int set_qamx_impl(int amx, const int* min_tokens);
void ensure_qconfig() {
  if (g_qisa.load() < 0) set_qmode(-1, -1);
  if (g_qamx.load() < 0) set_qamx_impl(-1, nullptr);
}
// ---------------------------------------------------------------- AMX-INT8 tiles (a8 on AVX-512)

bool has_amx_int8() {
  const Cpu& c = cpu();
  return has_avx512_quant() && c.has[kAmxTile] && c.has[kAmxInt8] && c.has[kOsAmx];
}

#if defined(__x86_64__)
// The tile kernel against the AVX-512 one on a row group of 3 units, 16 and 5 tokens, both formats:
// exact int32 sums and the same fp32 steps, so the bits must agree; where they do not (a CPU, OS or
// compiler fault) the tiles stay off and qamx_status() says why.
bool qamx_agrees(const QuantOps& tiles) {
  constexpr int kUnits = 3, kT = 16, kKb = 2 * kUnits;
  alignas(64) static uint8_t w[kUnits * 1088];
  alignas(64) static int8_t xq[kKb * kT * kQK];
  static float xd[kKb * kT], a[kT * kQRows], b[kT * kQRows];
  static int32_t xs[kKb * kT];
  uint32_t r = 2463534242u;
  auto next = [&r] {
    r ^= r << 13;
    r ^= r >> 17;
    r ^= r << 5;
    return r;
  };
  for (int fmt = 0; fmt < kNumQFormats; ++fmt) {
    const int64_t ub = q_unit_bytes(fmt);
    for (int u = 0; u < kUnits; ++u) {
      uint8_t* unit = w + u * ub;
      for (int i = 0; i < 32; ++i) {  // scales: small fp16 values
        const uint16_t h = f32_to_half(float(int(next() % 64) - 32) / 256.0f);
        std::memcpy(unit + 2 * i, &h, 2);
      }
      for (int64_t i = 64; i < ub; ++i) unit[i] = uint8_t(next());
    }
    for (int kb = 0; kb < kKb; ++kb)
      for (int t = 0; t < kT; ++t) {
        int32_t sum = 0;
        for (int i = 0; i < kQK; ++i) {
          const int8_t v = int8_t(int(next() % 255) - 127);
          xq[(kb * kT + t) * kQK + i] = v;
          sum += v;
        }
        xs[kb * kT + t] = -q_zero(fmt) * sum;
        xd[kb * kT + t] = float(int(next() % 100) + 1) / 1024.0f;
      }
    for (int m : {kT, 5}) {
      kQuantAvx512Ops.mk_a8(fmt, w, kUnits, xq, xd, xs, kT, m, a);
      tiles.mk_a8(fmt, w, kUnits, xq, xd, xs, kT, m, b);
      if (std::memcmp(a, b, sizeof(float) * m * kQRows) != 0) return false;
    }
  }
  return true;
}
#endif

bool qamx_selfcheck() {
#if defined(__x86_64__)
  static const bool ok = [] {
    int min[kNumQFormats];
    for (int f = 0; f < kNumQFormats; ++f) min[f] = g_qamx_min_tokens[f].exchange(1);  // every m through the tiles
    const bool agree = qamx_agrees(kQuantAmxOps);
    for (int f = 0; f < kNumQFormats; ++f) g_qamx_min_tokens[f] = min[f];
    g_qamx_status = agree ? "ok" : "disabled: the AMX-INT8 self-check disagreed with the AVX512-VNNI path";
    return agree;
  }();
  return ok;
#else
  return false;
#endif
}

const QuantOps& qops() {
  ensure_qconfig();
#if defined(__x86_64__)
  if (g_qisa.load() == kIsaAvx512F && g_qmode.load() == kQModeA8) {
    if (g_qamx.load() == kAmxHw) return kQuantAmxOps;
    if (g_qamx.load() == kAmxEmulated) return kQuantAmxEmuOps;
  }
  if (g_qisa.load() == kIsaAvx512F) return kQuantAvx512Ops;
  if (g_qisa.load() == kIsaAvx2) return kQuantAvx2Ops;
#endif
  return kQuantGenericOps;
}
}  // namespace

// The automatic quantized path: this CPU's best, which needs no AVX512-BF16 (an Intel Cascade or Ice Lake, or a
// VM that hides BF16, runs the bf16 experts on the AVX-512 F path and the quantized ones on VNNI); a vector path set below the
// CPU's best (FIDDLER_KERNEL_ISA=avx2 on an AVX-512 CPU, a proxy for another CPU class) takes it down with it.
static int auto_qisa() {
  const int vector = current_isa();
  return vector < best_isa() ? std::min(best_qisa(), vector) : best_qisa();
}

int set_qmode(int mode, int isa) {
  if (isa < 0) isa = auto_qisa();
  if (isa > kIsaAvx512F) return fail("unknown ISA code " + std::to_string(isa));
  if (isa == kIsaAvx512F && !has_avx512_quant())
    return fail("this CPU (or OS) has no AVX512 VNNI (needs avx512f/bw/vl/vnni, f16c) for the quantized path");
  if (isa == kIsaAvx2 && !has_avx2_quant())
    return fail("this CPU (or OS) has no AVX2+FMA+F16C for the quantized path");
  const bool automatic = mode < 0;
  if (automatic) mode = default_qmode(isa);
  if (mode != kQModeA8 && mode != kQModeW) return fail("unknown quantized mode " + std::to_string(mode));
  g_qisa = isa;
  g_qmode = mode;
  g_qsource = automatic ? "default" : "set";
  return 0;
}
int qmode() {
  ensure_qconfig();
  return g_qmode.load();
}
int qisa() {
  ensure_qconfig();
  return g_qisa.load();
}
const char* qmode_source() { return g_qsource; }

namespace {
int set_qamx_impl(int amx, const int* min_tokens) {
  for (int f = 0; f < kNumQFormats; ++f)
    if (min_tokens && min_tokens[f] > kQAmxNever)
      return fail("qamx: min_tokens must be at most " + std::to_string(kQAmxNever) + " (never)");
  if (amx < 0) amx = has_amx_int8() && request_amx_permission() && qamx_selfcheck() ? kAmxHw : kAmxOff;
  if (amx == kAmxHw) {
    if (!has_amx_int8()) return fail("this CPU (or OS) has no AMX-INT8 (needs amx_tile, amx_int8, AVX512-VNNI)");
    if (!request_amx_permission()) return fail("the kernel refused AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM failed)");
    if (!qamx_selfcheck()) return fail(std::string("AMX-INT8 ") + g_qamx_status);
  } else if (amx == kAmxEmulated) {
    if (!has_avx512_quant()) return fail("the emulated AMX-INT8 path runs on the AVX512-VNNI path, which this CPU lacks");
  } else if (amx != kAmxOff) {
    return fail("unknown AMX mode " + std::to_string(amx));
  }
  for (int f = 0; f < kNumQFormats; ++f)
    g_qamx_min_tokens[f] = min_tokens && min_tokens[f] > 0 ? min_tokens[f] : kDefaultQAmxMinTokens[f];
  g_qamx = amx;
  return 0;
}
}  // namespace

int set_qamx(int amx, const int* min_tokens) {
  ensure_qconfig();
  return set_qamx_impl(amx, min_tokens);
}
int qamx() {
  ensure_qconfig();
  return g_qisa.load() == kIsaAvx512F && g_qmode.load() == kQModeA8 ? g_qamx.load() : int(kAmxOff);
}
int qamx_min_tokens(int fmt) { return g_qamx_min_tokens[fmt].load(); }
const char* qamx_status() { return g_qamx_status; }

// ---------------------------------------------------------------- quantization and packing
int quantize_rows(int fmt, const float* x, int64_t n, int64_t k, uint8_t* dst, int threads) {
  if (fmt < 0 || fmt >= kNumQFormats || !x || !dst || n <= 0 || k <= 0 || k % kQK)
    return fail("quantize_rows: bad arguments (k must be a multiple of 32)");
  const int64_t nkb = k / kQK, bb = q_block_bytes(fmt);
  pool().run(thread_count(threads, n, n * k * 4, 1), n, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const float* v = x + r * k + kb * kQK;
        uint8_t* o = dst + (r * nkb + kb) * bb;
        if (fmt == kQ8_0) {
          float amax = 0.0f;
          for (int i = 0; i < kQK; ++i) amax = std::max(amax, std::fabs(v[i]));
          const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
          const uint16_t dh = f32_to_half(d);
          std::memcpy(o, &dh, 2);
          for (int i = 0; i < kQK; ++i) o[2 + i] = uint8_t(int8_t(std::round(v[i] * id)));
        } else {
          float amax = 0.0f, mx = 0.0f;
          for (int i = 0; i < kQK; ++i)
            if (amax < std::fabs(v[i])) {
              amax = std::fabs(v[i]);
              mx = v[i];
            }
          const float d = mx / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
          const uint16_t dh = f32_to_half(d);
          std::memcpy(o, &dh, 2);
          for (int i = 0; i < kQK / 2; ++i) {
            const int lo = std::min(15, int(int8_t(v[i] * id + 8.5f)));
            const int hi = std::min(15, int(int8_t(v[kQK / 2 + i] * id + 8.5f)));
            o[2 + i] = uint8_t(lo | (hi << 4));
          }
        }
      }
  });
  return 0;
}

int64_t qpacked_bytes(int fmt, int64_t n, int64_t k, int groups) {
  if (fmt < 0 || fmt >= kNumQFormats || n <= 0 || k <= 0 || groups <= 0) return -1;
  return round_up(n, kQRows) / kQRows * groups * (round_up(k, kQAlignK) / kQAlignK) * q_unit_bytes(fmt);
}

namespace {
inline int64_t rg_bytes(int fmt, int64_t k) { return round_up(k, kQAlignK) / kQAlignK * q_unit_bytes(fmt); }
}  // namespace

int qpack(int fmt, const uint8_t* const* src, int groups, int64_t n, int64_t k, void* dst, int threads) {
  const int64_t bytes = qpacked_bytes(fmt, n, k, groups);
  if (bytes < 0 || !src || !dst || k % kQK) return fail("fk_qpack: bad arguments (k must be a multiple of 32)");
  if (reinterpret_cast<uintptr_t>(dst) % 64) return fail("fk_qpack: destination is not 64-byte aligned");
  const int64_t n_rg = round_up(n, kQRows) / kQRows, nkb = k / kQK;
  const int64_t rgb = rg_bytes(fmt, k), bb = q_block_bytes(fmt), qb = bb - 2;
  pool().run(thread_count(threads, n_rg, bytes, 1), n_rg, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t rg = g0; rg < g1; ++rg)
      for (int g = 0; g < groups; ++g) {
        uint8_t* s = static_cast<uint8_t*>(dst) + (rg * groups + g) * rgb;
        std::memset(s, 0, size_t(rgb));
        for (int r = 0; r < kQRows; ++r) {
          const int64_t row = rg * kQRows + r;
          if (row >= n) break;
          for (int64_t kb = 0; kb < nkb; ++kb) {
            const uint8_t* blk = src[g] + (row * nkb + kb) * bb;
            uint8_t* unit = s + (kb / 2) * q_unit_bytes(fmt);
            const int b = int(kb % 2);
            std::memcpy(unit + b * 32 + r * 2, blk, 2);
            for (int64_t j = 0; j < qb / 4; ++j) {
              uint8_t* d = unit + 64 + b * q_quant_bytes(fmt) + (j * kQRows + r) * 4;
              std::memcpy(d, blk + 2 + 4 * j, 4);
              if (fmt == kQ8_0)
                for (int c = 0; c < 4; ++c) d[c] ^= 0x80;  // q + 128
            }
          }
        }
      }
  });
  return 0;
}

int qunpack(int fmt, const void* packed, int groups, int g, int64_t n, int64_t k, uint8_t* dst) {
  if (qpacked_bytes(fmt, n, k, groups) < 0 || !packed || !dst || k % kQK || g < 0 || g >= groups)
    return fail("fk_qunpack: bad arguments");
  const int64_t nkb = k / kQK, rgb = rg_bytes(fmt, k), bb = q_block_bytes(fmt), qb = bb - 2;
  for (int64_t row = 0; row < n; ++row) {
    const int64_t rg = row / kQRows, r = row % kQRows;
    const uint8_t* s = static_cast<const uint8_t*>(packed) + (rg * groups + g) * rgb;
    for (int64_t kb = 0; kb < nkb; ++kb) {
      const uint8_t* unit = s + (kb / 2) * q_unit_bytes(fmt);
      const int b = int(kb % 2);
      uint8_t* blk = dst + (row * nkb + kb) * bb;
      std::memcpy(blk, unit + b * 32 + r * 2, 2);
      for (int64_t j = 0; j < qb / 4; ++j) {
        std::memcpy(blk + 2 + 4 * j, unit + 64 + b * q_quant_bytes(fmt) + (j * kQRows + r) * 4, 4);
        if (fmt == kQ8_0)
          for (int c = 0; c < 4; ++c) blk[2 + 4 * j + c] ^= 0x80;
      }
    }
  }
  return 0;
}

// ---------------------------------------------------------------- drivers
namespace {

template <class T>
T* qscratch(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// Activations of one pass in the form the active mode reads; one per input (x, and h per expert).
struct Acts {
  std::vector<int8_t> q;   // a8: the block-major layout (fk_quant.h)
  std::vector<float> d;
  std::vector<int32_t> s;
  std::vector<float> f;    // w: [tokens][kp]
  int64_t kp = 0, tokens = 0;
  std::vector<int8_t> row_q;  // one token's row-major quants, before they go block-major
  std::vector<float> row_d;
  std::vector<int32_t> row_s;
};

// bf16 or fp32 rows x[tokens][k] (row stride ldx) -> the mode's activations with K padded to kp with
// zeros. a8: per 32-block d = amax / 127 rounded to fp16 (used as such), q = round-half-even(x * 127 /
// amax), as llama.cpp's x86 quantize_row_q8_0 does; s the correction for weights of format fmt.
inline float to_f32(uint16_t v) { return bf16_to_f32(v); }
inline float to_f32(float v) { return v; }
inline void quant_row(const QuantOps& ops, const uint16_t* x, int64_t k, int64_t kp, int8_t* q, float* d, int32_t* s) {
  ops.quant_row(x, k, kp, q, d, s);
}
inline void quant_row(const QuantOps& ops, const float* x, int64_t k, int64_t kp, int8_t* q, float* d, int32_t* s) {
  ops.quant_row_f32(x, k, kp, q, d, s);
}

template <class T>
void prepare_acts(int mode, int fmt, const T* x, int64_t ldx, int64_t tokens, int64_t k, int64_t kp, Acts& a) {
  a.kp = kp;
  a.tokens = tokens;
  const int64_t nkb = kp / kQK;
  if (mode == kQModeW) {
    float* f = qscratch(a.f, size_t(tokens * kp));
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t i = 0; i < k; ++i) f[t * kp + i] = to_f32(x[t * ldx + i]);
      for (int64_t i = k; i < kp; ++i) f[t * kp + i] = 0.0f;
    }
    return;
  }
  int8_t* q = qscratch(a.q, size_t(tokens * kp));
  float* d = qscratch(a.d, size_t(tokens * nkb));
  int32_t* s = qscratch(a.s, size_t(tokens * nkb));
  int8_t* rq = qscratch(a.row_q, size_t(kp));
  float* rd = qscratch(a.row_d, size_t(nkb));
  int32_t* rs = qscratch(a.row_s, size_t(nkb));
  const QuantOps& ops = qops();
  for (int64_t t = 0; t < tokens; ++t) {
    quant_row(ops, x + t * ldx, k, kp, rq, rd, rs);
    for (int64_t kb = 0; kb < nkb; ++kb) {
      std::memcpy(q + (kb * tokens + t) * kQK, rq + kb * kQK, kQK);
      d[kb * tokens + t] = rd[kb];
      s[kb * tokens + t] = -q_zero(fmt) * rs[kb];
    }
  }
}

void prepare_acts(int mode, int fmt, const void* x, bool x_f32, int64_t ldx, int64_t tokens, int64_t k, int64_t kp,
                  Acts& a) {
  if (x_f32)
    prepare_acts(mode, fmt, static_cast<const float*>(x), ldx, tokens, k, kp, a);
  else
    prepare_acts(mode, fmt, static_cast<const uint16_t*>(x), ldx, tokens, k, kp, a);
}

// acc[tokens][16] for one row group's stream w (all tokens, token groups of ops.mr)
void rowgroup_product(const QuantOps& ops, int mode, int fmt, const uint8_t* w, int64_t units, const Acts& a,
                      int64_t tokens, float* acc) {
  for (int64_t t0 = 0; t0 < tokens; t0 += ops.mr) {
    const int m = int(std::min<int64_t>(ops.mr, tokens - t0));
    if (mode == kQModeA8)
      ops.mk_a8(fmt, w, units, a.q.data() + t0 * kQK, a.d.data() + t0, a.s.data() + t0, a.tokens, m,
                acc + t0 * kQRows);
    else
      ops.mk_w(fmt, w, units, a.f.data() + t0 * a.kp, a.kp, m, acc + t0 * kQRows);
  }
}

// A thread that claims a range of row groups jumps to a new place in the weights, where its stream
// prefetch (a fixed distance ahead of its loads) has not run yet: the first `distance` bytes would be
// demand misses one after another. Prefetch them at once (and the L2 prefetch's window into L2).
void warm_stream(const uint8_t* p, int64_t bytes) {
  const StreamTuning st = stream_tuning();
  const int64_t near = std::min<int64_t>(bytes, st.hint != kHintNone ? st.distance : 0);
  const int64_t far = std::min<int64_t>(bytes, st.far);
  for (int64_t l = 0; l < near; l += 64) __builtin_prefetch(p + l, 0, 3);
  for (int64_t l = near; l < far; l += 64) __builtin_prefetch(p + l, 0, 2);
}

thread_local std::vector<float> t_qacc;
thread_local Acts t_ax;
thread_local std::vector<Acts> t_ah;
thread_local std::vector<float> t_qh;
thread_local std::vector<uint16_t> t_qy;

bool bad_fmt(int fmt) { return fmt < 0 || fmt >= kNumQFormats; }

}  // namespace

int qlinear(int fmt, const void* packed, int64_t n, int64_t k, const void* x, bool x_f32, int64_t tokens,
            const float* bias, void* y, bool out_f32, int threads) {
  if (bad_fmt(fmt) || !packed || !x || !y || n <= 0 || k <= 0 || tokens <= 0) return fail("qlinear: bad arguments");
  const QuantOps& ops = qops();
  const IsaOps& vo = vector_ops(current_isa());
  const int mode = qmode();
  const int64_t kp = round_up(k, kQAlignK), units = kp / kQAlignK, n_rg = round_up(n, kQRows) / kQRows;
  const int64_t rgb = rg_bytes(fmt, k);
  const size_t es = out_f32 ? 4 : 2;
  prepare_acts(mode, fmt, x, x_f32, k, tokens, k, kp, t_ax);
  const Acts& a = t_ax;
  const auto* w = static_cast<const uint8_t*>(packed);
  pool().run(thread_count(threads, n_rg, n_rg * rgb, tokens), n_rg, 1, [&](int64_t g0, int64_t g1) {
    float* acc = qscratch(t_qacc, size_t(tokens * kQRows));
    warm_stream(w + g0 * rgb, (g1 - g0) * rgb);
    for (int64_t rg = g0; rg < g1; ++rg) {
      rowgroup_product(ops, mode, fmt, w + rg * rgb, units, a, tokens, acc);
      const int64_t nv = std::min<int64_t>(kQRows, n - rg * kQRows);
      for (int64_t t = 0; t < tokens; ++t)
        vo.store(acc + t * kQRows, bias ? bias + rg * kQRows : nullptr, nv,
                 static_cast<char*>(y) + (t * n + rg * kQRows) * es, out_f32);
    }
  });
  return 0;
}

namespace {
// The gate/up pass of expert e's row groups [g0, g1): h[t][rg*16 ..] = bf16(silu(W1 x) * (W3 x)).
void gate_up_rows(const QuantOps& ops, int mode, int fmt, const uint8_t* w13, int64_t units13,
                  int64_t rgb13, const Acts& a, int64_t tokens, int64_t rg, float* h, int64_t ldh, float* acc) {
  rowgroup_product(ops, mode, fmt, w13 + (2 * rg) * rgb13, units13, a, tokens, acc);
  rowgroup_product(ops, mode, fmt, w13 + (2 * rg + 1) * rgb13, units13, a, tokens, acc + tokens * kQRows);
  for (int64_t t = 0; t < tokens; ++t)
    ops.silu_mul_f32(acc + t * kQRows, acc + (tokens + t) * kQRows, kQRows, h + t * ldh + rg * kQRows);
}
}  // namespace

int qexpert_ffn(int fmt, const void* p13, const void* p2, int64_t hidden, int64_t ffn, const void* x, bool x_f32,
                int64_t tokens, uint16_t* y, int threads) {
  const void* a13[1] = {p13};
  const void* a2[1] = {p2};
  const uint16_t one = 0x3f80;  // bf16 1.0: the MoE combine with one expert of weight 1 is the identity
  if (!p13 || !p2) return fail("qexpert_ffn: bad arguments");
  return qmoe_ffn(fmt, a13, a2, &one, 1, hidden, ffn, x, x_f32, tokens, y, threads);
}

// As moe_ffn (fk_driver.cpp) for quantized experts: two pooled regions, the same combine roundings.
int qmoe_ffn(int fmt, const void* const* p13, const void* const* p2, const uint16_t* w, int n_experts,
             int64_t hidden, int64_t ffn, const void* x, bool x_f32, int64_t tokens, uint16_t* y, int threads) {
  if (bad_fmt(fmt) || !p13 || !p2 || !w || !x || !y || n_experts <= 0 || hidden <= 0 || ffn <= 0 || tokens <= 0)
    return fail("qmoe_ffn: bad arguments");
  for (int e = 0; e < n_experts; ++e)
    if (!p13[e] || !p2[e]) return fail("qmoe_ffn: null expert weights");
  const QuantOps& ops = qops();
  const IsaOps& vo = vector_ops(current_isa());
  const int mode = qmode();
  const int64_t kp_h = round_up(hidden, kQAlignK), kp_f = round_up(ffn, kQAlignK);
  const int64_t u_h = kp_h / kQAlignK, u_f = kp_f / kQAlignK;
  const int64_t rg_f = round_up(ffn, kQRows) / kQRows, rg_h = round_up(hidden, kQRows) / kQRows;
  const int64_t rgb13 = rg_bytes(fmt, hidden), rgb2 = rg_bytes(fmt, ffn);
  const int64_t ldh = kp_f, h_stride = tokens * ldh;
  prepare_acts(mode, fmt, x, x_f32, hidden, tokens, hidden, kp_h, t_ax);
  const Acts& ax = t_ax;
  float* h = qscratch(t_qh, size_t(n_experts * h_stride));  // fp32, as llama.cpp keeps it
  const int64_t items1 = n_experts * rg_f;
  pool().run(thread_count(threads, items1, 2 * items1 * rgb13, tokens), items1, 1, [&](int64_t i0, int64_t i1) {
    float* acc = qscratch(t_qacc, size_t(2 * tokens * kQRows));
    warm_stream(static_cast<const uint8_t*>(p13[i0 / rg_f]) + (i0 % rg_f) * 2 * rgb13, 2 * rgb13);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = i / rg_f, rg = i % rg_f;
      gate_up_rows(ops, mode, fmt, static_cast<const uint8_t*>(p13[e]), u_h, rgb13, ax, tokens, rg,
                   h + e * h_stride, ldh, acc);
    }
  });
  // h's columns past the last row group (K padding of the down pass) are zero
  if (t_ah.size() < size_t(n_experts)) t_ah.resize(size_t(n_experts));
  for (int e = 0; e < n_experts; ++e) {
    float* he = h + e * h_stride;
    for (int64_t t = 0; t < tokens; ++t)
      std::memset(he + t * ldh + rg_f * kQRows, 0, size_t(ldh - rg_f * kQRows) * sizeof(float));
    prepare_acts(mode, fmt, he, ldh, tokens, ldh, kp_f, t_ah[size_t(e)]);
  }
  uint16_t* ye = qscratch(t_qy, size_t(n_experts * tokens * hidden));
  const std::vector<Acts>& ah = t_ah;
  const int64_t items2 = n_experts * rg_h;
  pool().run(thread_count(threads, items2, items2 * rgb2, tokens), items2, 1, [&](int64_t i0, int64_t i1) {
    float* acc = qscratch(t_qacc, size_t(tokens * kQRows));
    warm_stream(static_cast<const uint8_t*>(p2[i0 / rg_h]) + (i0 % rg_h) * rgb2, rgb2);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = i / rg_h, rg = i % rg_h;
      rowgroup_product(ops, mode, fmt, static_cast<const uint8_t*>(p2[e]) + rg * rgb2, u_f, ah[size_t(e)], tokens,
                       acc);
      const int64_t nv = std::min<int64_t>(kQRows, hidden - rg * kQRows);
      for (int64_t t = 0; t < tokens; ++t)
        vo.store(acc + t * kQRows, nullptr, nv, ye + (e * tokens + t) * hidden + rg * kQRows, false);
    }
  });
  combine_experts(ye, w, n_experts, tokens * hidden, y);
  return 0;
}

}  // namespace fk

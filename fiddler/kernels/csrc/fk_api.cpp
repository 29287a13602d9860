// Definitions of the C entry points declared in fk_api.h (called through ctypes, which releases the
// GIL), apart from the decode ops (fk_decode.cpp) and the prefill attention (fk_attention.cpp).
// Thin wrappers: the work lives in fk_cpu.cpp, fk_tuning.cpp, fk_pool.cpp, fk_driver.cpp and
// fk_probe.cpp (see fk_internal.h). Errors return -1 (or a negative value) and fk_last_error().
#include "fk_api.h"
#include "fk_internal.h"
#include "fk_quant.h"

using namespace fk;

FK_API const char* fk_last_error() { return last_error(); }

// ---------------------------------------------------------------- constants
namespace {
struct Constant {
  const char* name;
  int64_t value;
};
// by the names fiddler/kernels/constants.py's exported() gives them (tests/test_kernel_api.py)
const Constant kConstants[] = {
    {"isa.generic", kIsaGeneric}, {"isa.avx2", kIsaAvx2}, {"isa.avx512", kIsaAvx512F},
    {"isa.avx512_bf16", kIsaAvx512Bf16},
    {"amx.off", kAmxOff}, {"amx.on", kAmxHw}, {"amx.emulated", kAmxEmulated},
    {"hint.none", kHintNone}, {"hint.t0", kHintT0}, {"hint.t1", kHintT1}, {"hint.nta", kHintNta},
    {"qmode.a8", kQModeA8}, {"qmode.w", kQModeW}, {"quant.amx_never", kQAmxNever},
    {"quant.qk", kQK}, {"quant.rows", kQRows}, {"quant.align_k", kQAlignK},
    {"bf16.block_n", kBlockN}, {"bf16.align_k", kAlignK},
    {"q8_0.code", kQ8_0}, {"q8_0.block_bytes", q_block_bytes(kQ8_0)}, {"q8_0.quant_bytes", q_quant_bytes(kQ8_0)},
    {"q4_0.code", kQ4_0}, {"q4_0.block_bytes", q_block_bytes(kQ4_0)}, {"q4_0.quant_bytes", q_quant_bytes(kQ4_0)},
};
constexpr int kNumConstants = int(sizeof(kConstants) / sizeof(kConstants[0]));
}  // namespace

FK_API int64_t fk_constant(const char* name) {
  for (const Constant& c : kConstants)
    if (name && std::string(name) == c.name) return c.value;
  return fail(std::string("unknown constant ") + (name ? name : "(null)"));
}
FK_API const char* fk_constant_name(int i) { return i >= 0 && i < kNumConstants ? kConstants[i].name : nullptr; }

// ---------------------------------------------------------------- configuration
FK_API int fk_configure(int isa, int amx, int amx_min_tokens) { return configure(isa, amx, amx_min_tokens); }
FK_API int fk_isa() { return current_isa(); }
FK_API int fk_amx_mode() { return amx_mode(); }
FK_API int fk_amx_min_tokens() { return amx_min_tokens(); }
// "ok", "not checked" (no AMX, or never requested) or why the AMX path was disabled.
FK_API const char* fk_amx_status() { return amx_status().c_str(); }

// Feature i (0 <= i < fk_num_features()): name and whether this CPU/OS has it.
FK_API int fk_num_features() { return kNumFeatures; }
FK_API const char* fk_feature_name(int i) { return i >= 0 && i < kNumFeatures ? kFeatureNames[i] : ""; }
FK_API int fk_feature(int i) { return i >= 0 && i < kNumFeatures ? cpu().has[i] : 0; }
FK_API int fk_best_isa() { return best_isa(); }
FK_API int fk_amx_supported() { return cpu().amx(); }
FK_API int fk_compiled_x86() {
#if defined(__x86_64__)
  return 1;
#else
  return 0;
#endif
}

FK_API void fk_set_num_threads(int n) { set_default_threads(n); }
// fn(ctx, begin, end) over [0, items) on the kernel's pool, as the kernels run their regions: lets a
// caller (the tests) hold the pool with a region of its own and check what another call does meanwhile
FK_API void fk_parallel_for(int threads, int64_t items, fk_range_fn fn, const void* ctx) {
  parallel_for(threads, items, fn, ctx);
}
FK_API int fk_get_num_threads() { return default_threads(); }

// Weight-stream knobs: hint (0 none, 1 t0, 2 t1, 3 nta; -1: back to the per-CPU default), its
// distance in bytes, and the L2 prefetch's distance (0: none); `source` is recorded with the choice.
FK_API int fk_set_stream(int hint, int64_t distance, int64_t far, const char* source) {
  return set_stream_tuning(hint, distance, far, source);
}
FK_API int fk_stream_hint() { return stream_tuning().hint; }
FK_API int64_t fk_stream_distance() { return stream_tuning().distance; }
FK_API int64_t fk_stream_far() { return stream_tuning().far; }
FK_API const char* fk_stream_source() { return stream_tuning_source(); }
// Many-token blocking: out[0..4] = K chunk, token chunk, super-blocks, L1d bytes, L2 bytes; for the
// given cache sizes (both > 0) or, with zeros, this CPU's.
FK_API void fk_blocking(int64_t l1d, int64_t l2, int64_t* out) {
  const Blocking b = l1d > 0 && l2 > 0 ? derive_blocking(l1d, l2) : blocking();
  const int64_t v[5] = {b.k_chunk, b.token_chunk, b.super_blocks, b.l1d, b.l2};
  for (int i = 0; i < 5; ++i) out[i] = v[i];
}
// calls of up to rows[i] token rows use values[i] super-blocks (n entries; 0: the default)
FK_API int fk_set_super_blocks(const int64_t* rows, const int64_t* values, int n) {
  return set_super_blocks(rows, values, n);
}
// the super-blocks a call of `rows` token rows uses
FK_API int64_t fk_super_blocks_for(int64_t rows) { return blocking(rows).super_blocks; }

// ---------------------------------------------------------------- packing and drivers
FK_API int64_t fk_packed_bytes(int64_t n, int64_t k, int groups) { return packed_bytes(n, k, groups); }
// Best-effort: back a large buffer (before it is first written) with transparent huge pages.
FK_API void fk_advise_hugepages(void* p, int64_t nbytes) { advise_hugepages(p, nbytes); }
FK_API int fk_pack(const uint16_t* const* ws, int groups, int64_t n, int64_t k, void* dst, int threads) {
  return pack(ws, groups, n, k, dst, threads);
}
FK_API int fk_expert_ffn(const void* p13, const void* p2, int64_t hidden, int64_t ffn,
                         const uint16_t* x, int64_t tokens, uint16_t* y, int threads) {
  return expert_ffn(p13, p2, hidden, ffn, x, tokens, y, threads);
}
FK_API int fk_moe_ffn(const void* const* p13, const void* const* p2, const uint16_t* w, int n_experts,
                      int64_t hidden, int64_t ffn, const uint16_t* x, int64_t tokens, uint16_t* y,
                      int threads) {
  return moe_ffn(p13, p2, w, n_experts, hidden, ffn, x, tokens, y, threads);
}
FK_API int fk_linear(const void* packed, int64_t n, int64_t k, const uint16_t* x, int64_t tokens,
                     const float* bias, void* y, int out_f32, int threads) {
  return linear(packed, n, k, x, tokens, bias, y, out_f32 != 0, threads);
}

// ---------------------------------------------------------------- quantized weights (fk_quant.h)
// fmt: 0 = Q8_0, 1 = Q4_0 (llama.cpp's blocks); mode: 0 = a8, 1 = w, -1 = the per-CPU default.
FK_API int64_t fk_qpacked_bytes(int fmt, int64_t n, int64_t k, int groups) { return qpacked_bytes(fmt, n, k, groups); }
FK_API int fk_qpack(int fmt, const uint8_t* const* src, int groups, int64_t n, int64_t k, void* dst, int threads) {
  return qpack(fmt, src, groups, n, k, dst, threads);
}
FK_API int fk_qunpack(int fmt, const void* packed, int groups, int g, int64_t n, int64_t k, uint8_t* dst) {
  return qunpack(fmt, packed, groups, g, n, k, dst);
}
FK_API int fk_quantize_rows(int fmt, const float* x, int64_t n, int64_t k, uint8_t* dst, int threads) {
  return quantize_rows(fmt, x, n, k, dst, threads);
}
FK_API int fk_qlinear(int fmt, const void* packed, int64_t n, int64_t k, const void* x, int x_f32, int64_t tokens,
                      const float* bias, void* y, int out_f32, int threads) {
  return qlinear(fmt, packed, n, k, x, x_f32 != 0, tokens, bias, y, out_f32 != 0, threads);
}
FK_API int fk_qexpert_ffn(int fmt, const void* p13, const void* p2, int64_t hidden, int64_t ffn, const void* x,
                          int x_f32, int64_t tokens, uint16_t* y, int threads) {
  return qexpert_ffn(fmt, p13, p2, hidden, ffn, x, x_f32 != 0, tokens, y, threads);
}
FK_API int fk_qmoe_ffn(int fmt, const void* const* p13, const void* const* p2, const uint16_t* w, int n_experts,
                       int64_t hidden, int64_t ffn, const void* x, int x_f32, int64_t tokens, uint16_t* y,
                       int threads) {
  return qmoe_ffn(fmt, p13, p2, w, n_experts, hidden, ffn, x, x_f32 != 0, tokens, y, threads);
}
FK_API int fk_set_qmode(int mode, int isa) { return set_qmode(mode, isa); }
FK_API int fk_qmode() { return qmode(); }
FK_API int fk_qisa() { return qisa(); }
FK_API const char* fk_qmode_source() { return qmode_source(); }
// min_tokens: per format (Q8_0, Q4_0), <= 0 the default, 17 never
FK_API int fk_set_qamx(int amx, int min_q8_0, int min_q4_0) {
  const int m[2] = {min_q8_0, min_q4_0};
  return set_qamx(amx, m);
}
FK_API int fk_qamx() { return qamx(); }
FK_API int fk_qamx_min_tokens(int fmt) { return fmt == 0 || fmt == 1 ? qamx_min_tokens(fmt) : -1; }
FK_API const char* fk_qamx_status() { return qamx_status(); }
FK_API int fk_set_qpass(int tokens, const char* source) { return set_qpass(tokens, source); }
FK_API int fk_qpass() { return qpass(); }
FK_API const char* fk_qpass_source() { return qpass_source(); }

// ---------------------------------------------------------------- probe
// GB/s of a streaming read of buf[0, nbytes) (see fk_probe.cpp); negative on error.
FK_API double fk_read_bandwidth(const void* buf, int64_t nbytes, int threads, int hint, int64_t dist,
                                int repeats) {
  return read_bandwidth(buf, nbytes, threads, hint, dist, repeats);
}

// GFLOP/s of one instruction kind on registers only (see fk_isa_peak.cpp); negative on error.
FK_API double fk_isa_peak(const char* kind, int threads, double ops, int repeats) {
  return isa_peak(kind, threads, ops, repeats);
}

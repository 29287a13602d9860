// The C API of the Fiddler CPU kernel library: every exported entry point, declared once, here.
//
// fiddler/kernels/_lib.py builds its ctypes table from this file at import time, so the declarations
// keep one strict form that it parses (anything else starting with FK_API stops the load):
//
//     FK_API <type> <name>(<type> <arg>, <type> <arg>, ...);     // one line, optional trailing comment
//     typedef void (*fk_<name>_fn)(<params>);                      // a callback type, bound as a pointer
//
// <type>: void (a return only), int, int64_t, float, double, const char* (a C string), or any other
// pointer (an address: a tensor's data_ptr(), a ctypes array). No other scalar types (no bool, size_t,
// long): their width would differ between the C and the Python side.
//
// Definitions carry FK_API too (fk_api.cpp and the kernels' own files), so a definition that differs
// from its declaration is a compile error ("conflicting declaration of C function"); the library is
// built with -fvisibility=hidden, so nothing else is exported. tests/test_kernel_api.py compiles the
// Python table against this header and compares the library's exported symbols with it.
//
// Errors: an entry point that can fail returns a negative value; fk_last_error() then says why (the
// calling thread's last failure; one channel for the whole library).
//
// Adding an entry point: its declaration here, its definition (with FK_API) in a .cpp of csrc/.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
#define FK_API extern "C" __attribute__((visibility("default")))
#else
#define FK_API __attribute__((visibility("default")))
#endif

// fn(ctx, begin, end) over disjoint ranges covering [0, items) (fk_parallel_for)
typedef void (*fk_range_fn)(const void* ctx, int64_t begin, int64_t end);

// ---------------------------------------------------------------- errors and constants
FK_API const char* fk_last_error();  // why the calling thread's last failing call failed
// The constants the library and its callers share (ISA codes, block sizes, packed-layout parameters;
// fiddler/kernels/constants.py holds the same values): the value of `name`, or -1 (fk_last_error) if unknown.
FK_API int64_t fk_constant(const char* name);
FK_API const char* fk_constant_name(int i);  // the i-th constant's name; null past the last

// ---------------------------------------------------------------- configuration (fk_cpu.cpp, fk_tuning.cpp)
// isa: -1 auto, else an ISA code; amx: -1 auto, else an AMX mode; amx_min_tokens <= 0: the default
FK_API int fk_configure(int isa, int amx, int amx_min_tokens);
FK_API int fk_isa();  // the active vector path's ISA code (configures with auto on first use)
FK_API int fk_amx_mode();
FK_API int fk_amx_min_tokens();
FK_API const char* fk_amx_status();  // "ok", "not checked" or why the AMX path was disabled
FK_API int fk_num_features();
FK_API const char* fk_feature_name(int i);  // feature i's name ("" out of range)
FK_API int fk_feature(int i);  // whether this CPU/OS has feature i
FK_API int fk_best_isa();
FK_API int fk_amx_supported();
FK_API int fk_compiled_x86();
FK_API void fk_set_num_threads(int n);  // <= 0: all the CPUs this process may run on
FK_API int fk_get_num_threads();
// fn over [0, items) on the kernel's pool as the kernels run their regions (lets the tests hold the pool)
FK_API void fk_parallel_for(int threads, int64_t items, fk_range_fn fn, const void* ctx);
// Weight-stream prefetch: hint (a stream-hint code; -1: the per-CPU default), its distance and the L2
// prefetch's (0: none) in bytes; `source` (may be null) is recorded with the choice.
FK_API int fk_set_stream(int hint, int64_t distance, int64_t far, const char* source);
FK_API int fk_stream_hint();
FK_API int64_t fk_stream_distance();
FK_API int64_t fk_stream_far();
FK_API const char* fk_stream_source();
// Many-token blocking: out[0..4] = K chunk, token chunk, super-blocks, L1d, L2 bytes, for the given
// cache sizes (both > 0) or, with zeros, this CPU's.
FK_API void fk_blocking(int64_t l1d, int64_t l2, int64_t* out);
// calls of up to rows[i] token rows use values[i] super-blocks (n entries; 0: the default)
FK_API int fk_set_super_blocks(const int64_t* rows, const int64_t* values, int n);
FK_API int64_t fk_super_blocks_for(int64_t rows);

// ---------------------------------------------------------------- bf16 packing and drivers (fk_driver.cpp)
FK_API int64_t fk_packed_bytes(int64_t n, int64_t k, int groups);
FK_API void fk_advise_hugepages(void* p, int64_t nbytes);  // best effort: transparent huge pages
FK_API int fk_pack(const uint16_t* const* ws, int groups, int64_t n, int64_t k, void* dst, int threads);
FK_API int fk_expert_ffn(const void* p13, const void* p2, int64_t hidden, int64_t ffn, const uint16_t* x, int64_t tokens, uint16_t* y, int threads);
FK_API int fk_moe_ffn(const void* const* p13, const void* const* p2, const uint16_t* w, int n_experts, int64_t hidden, int64_t ffn, const uint16_t* x, int64_t tokens, uint16_t* y, int threads);
FK_API int fk_linear(const void* packed, int64_t n, int64_t k, const uint16_t* x, int64_t tokens, const float* bias, void* y, int out_f32, int threads);

// ---------------------------------------------------------------- quantized weights (fk_quant.cpp)
// fmt: a quant-format code; mode: a quant-mode code or -1 (the per-CPU default); isa: -1 or an ISA code
FK_API int64_t fk_qpacked_bytes(int fmt, int64_t n, int64_t k, int groups);
FK_API int fk_qpack(int fmt, const uint8_t* const* src, int groups, int64_t n, int64_t k, void* dst, int threads);
FK_API int fk_qunpack(int fmt, const void* packed, int groups, int g, int64_t n, int64_t k, uint8_t* dst);
FK_API int fk_quantize_rows(int fmt, const float* x, int64_t n, int64_t k, uint8_t* dst, int threads);
FK_API int fk_qlinear(int fmt, const void* packed, int64_t n, int64_t k, const void* x, int x_f32, int64_t tokens, const float* bias, void* y, int out_f32, int threads);
FK_API int fk_qexpert_ffn(int fmt, const void* p13, const void* p2, int64_t hidden, int64_t ffn, const void* x, int x_f32, int64_t tokens, uint16_t* y, int threads);
FK_API int fk_qmoe_ffn(int fmt, const void* const* p13, const void* const* p2, const uint16_t* w, int n_experts, int64_t hidden, int64_t ffn, const void* x, int x_f32, int64_t tokens, uint16_t* y, int threads);
FK_API int fk_set_qmode(int mode, int isa);
FK_API int fk_qmode();
FK_API int fk_qisa();
FK_API const char* fk_qmode_source();
// AMX-INT8 tiles: amx -1 auto, else an AMX mode; min_tokens per format (<= 0: the default; 17: never)
FK_API int fk_set_qamx(int amx, int min_q8_0, int min_q4_0);
FK_API int fk_qamx();
FK_API int fk_qamx_min_tokens(int fmt);  // -1 for an unknown format
FK_API const char* fk_qamx_status();
// tokens a pass of the AVX-512 VNNI a8 kernel at 9-16 tokens: 8 or 16, 0 = the per-CPU table
FK_API int fk_set_qpass(int tokens, const char* source);
FK_API int fk_qpass();
FK_API const char* fk_qpass_source();

// ---------------------------------------------------------------- probe (fk_probe.cpp)
// GB/s of a streaming read of buf[0, nbytes); negative on error
FK_API double fk_read_bandwidth(const void* buf, int64_t nbytes, int threads, int hint, int64_t dist, int repeats);
// GFLOP/s (int8: GOP/s) of one dot-product instruction kind on registers only, best of `repeats` runs of
// about `ops` operations each, spread over the threads (at least 64 loop iterations a thread): "avx512_bf16"
// (vdpbf16ps), "avx512_vnni" (vpdpbusd), "avx2_fma" (vfmadd231ps), "amx_bf16" (tdpbf16ps), "amx_int8"
// (tdpbssd); negative when unknown or not here
FK_API double fk_isa_peak(const char* kind, int threads, double ops, int repeats);

// ---------------------------------------------------------------- decode ops (fk_decode.cpp)
FK_API int fk_rmsnorm_bf16(const uint16_t* x, const uint16_t* w, int64_t rows, int64_t n, float eps, uint16_t* out);
FK_API int fk_rmsnorm_f32(const uint16_t* x, const float* w, int64_t rows, int64_t n, float eps, float* out);
FK_API int fk_rope_attn_decode_bf16(const uint16_t* qkv, int64_t B, int64_t nh, int64_t nkv, int64_t d, int64_t pos, const uint16_t* cos, const uint16_t* sin, uint16_t* kcache, uint16_t* vcache, int64_t max_batch, int64_t max_seq, int64_t window, float scale, uint16_t* out);
FK_API int fk_rope_attn_decode_rows_bf16(const uint16_t* qkv, int64_t B, int64_t nh, int64_t nkv, int64_t d, const int64_t* pos, const int64_t* rows, const uint16_t* cos, const uint16_t* sin, uint16_t* kcache, uint16_t* vcache, int64_t max_batch, int64_t max_seq, int64_t window, float scale, uint16_t* out);
// one layer's attention half and the MoE half's inputs in one call (see fk_decode.cpp)
FK_API int fk_decode_attn_block_bf16(const uint16_t* x, int64_t B, int64_t hidden, const uint16_t* norm1, const uint16_t* norm2, float eps, const void* qkv_w, const float* qkv_bias, const uint16_t* q_norm, const uint16_t* k_norm, const void* o_w, const float* o_bias, const void* router_w, int64_t n_experts, int64_t nh, int64_t nkv, int64_t d, const int64_t* pos, const int64_t* rows, const uint16_t* cos, const uint16_t* sin, uint16_t* kcache, uint16_t* vcache, int64_t max_batch, int64_t max_seq, int64_t window, float scale, uint16_t* h, uint16_t* qkv, uint16_t* att, uint16_t* o, uint16_t* x_out, uint16_t* h2, uint16_t* logits, int threads);
// the same for quantized projections (fmt as fk_qlinear) with fp32 norms: h and h2 fp32, no router (see fk_decode.cpp)
FK_API int fk_decode_attn_block_q(int fmt, const uint16_t* x, int64_t B, int64_t hidden, const float* norm1, const float* norm2, float eps, const void* qkv_w, const uint16_t* q_norm, const uint16_t* k_norm, const void* o_w, int64_t nh, int64_t nkv, int64_t d, const int64_t* pos, const int64_t* rows, const uint16_t* cos, const uint16_t* sin, uint16_t* kcache, uint16_t* vcache, int64_t max_batch, int64_t max_seq, int64_t window, float scale, float* h, uint16_t* qkv, uint16_t* att, uint16_t* o, uint16_t* x_out, float* h2, int threads);
// residual + fk_moe_ffn(...) in one call (the executor's decode row and the model's residual add)
FK_API int fk_moe_ffn_residual_bf16(const void* const* p13, const void* const* p2, const uint16_t* w, int n_experts, int64_t hidden, int64_t ffn, const uint16_t* x, const uint16_t* residual, int64_t tokens, uint16_t* y, int threads);

// ---------------------------------------------------------------- routing (fk_route.cpp)
// The top k of each row of fp32 router scores [rows, n_experts] into ids [rows, k] (decreasing) and bf16
// weights [rows, k] (renorm: divided by their sum, k <= 2); 1 (nothing promised) where a row's top k are
// not unambiguous (a tie at or within them, a NaN): the caller then runs torch.topk
FK_API int fk_route_topk_f32(const float* scores, int64_t rows, int64_t n_experts, int64_t k, int renorm, int64_t* ids, uint16_t* weights);

// ---------------------------------------------------------------- greedy token choice (fk_argmax.cpp)
// Each row of fp32 logits [rows, n]: idx[r] = its first largest index (torch.argmax's), or -1 where the row
// holds a NaN or an inf; returns how many rows did
FK_API int fk_argmax_f32(const float* x, int64_t rows, int64_t n, int64_t* idx);

// ---------------------------------------------------------------- prefill attention (fk_attention.cpp)
// needs the avx512_bf16 path; otherwise -1 and the caller uses torch
FK_API int fk_causal_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t B, int64_t nh, int64_t nkv, int64_t T, int64_t dk, int64_t dv, int64_t q_sb, int64_t q_sh, int64_t q_st, int64_t k_sb, int64_t k_sg, int64_t k_st, int64_t v_sb, int64_t v_sg, int64_t v_st, float scale, uint16_t* out, int threads);

// C entry points for the small per-token ops of a bf16 decode step (one new token per sequence):
// RMSNorm, and rope + KV-cache write + single-query GQA attention fused in one call. They touch
// kilobytes; the point is one ctypes call instead of dozens of torch ops (each ~5-100 us of
// dispatch). Results follow torch's bf16 rounding points (see each function); fiddler.model uses
// them for T == 1 and tests/test_decode_fastpath.py checks them against the torch ops.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fk_api.h"
#include "fk_internal.h"
#include "fk_quant.h"

namespace fk {
namespace decode {

// The ISA builds of the attention kernel (bit-identical results; see fk_decode_impl.h).
namespace generic {
#include "fk_decode_impl.h"
}
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "fk_decode_impl.h"
}
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace avx512 {
#include "fk_decode_impl.h"
}
#pragma GCC pop_options
#endif

namespace {

thread_local std::vector<float> g_scratch;

}  // namespace
}  // namespace decode
}  // namespace fk

using namespace fk::decode;
using fk::fail;  // the library's one error channel (fk_last_error)

namespace {
// The rows of one norm call: bf16 out with a bf16 weight (w, out), or fp32 out with an fp32 one (wf, outf).
struct NormRows {
  const uint16_t* x;
  const uint16_t* w;
  const float* wf;
  int64_t n;
  float eps;
  uint16_t* out;
  float* outf;
  int isa;
};

void norm_rows(const void* c, int64_t r0, int64_t r1) {
  const NormRows& a = *static_cast<const NormRows*>(c);
  std::vector<float>& s = g_scratch;  // per thread
  if (int64_t(s.size()) < 2 * a.n) s.resize(size_t(2 * a.n));
  float* h = s.data();
  switch (a.isa) {
#if defined(__x86_64__)
    case fk::kIsaAvx512Bf16:
      return a.outf ? avx512::rmsnorm_rows_f32(a.x, a.wf, a.n, a.eps, a.outf, r0, r1, h)
                    : avx512::rmsnorm_rows(a.x, a.w, a.n, a.eps, a.out, r0, r1, h);
    case fk::kIsaAvx512F:  // the AVX-512 F path's norms and attention are the AVX2 ones
    case fk::kIsaAvx2:
      return a.outf ? avx2::rmsnorm_rows_f32(a.x, a.wf, a.n, a.eps, a.outf, r0, r1, h)
                    : avx2::rmsnorm_rows(a.x, a.w, a.n, a.eps, a.out, r0, r1, h);
#endif
    default:
      return a.outf ? generic::rmsnorm_rows_f32(a.x, a.wf, a.n, a.eps, a.outf, r0, r1, h)
                    : generic::rmsnorm_rows(a.x, a.w, a.n, a.eps, a.out, r0, r1, h);
  }
}
}  // namespace

// out[r] = bf16(w * bf16(h * 1/sqrt(mean(h^2) + eps))), h = float(x[r]): fiddler.model.rms_norm on
// bf16 (torch: fp32 norm, cast to bf16, bf16 * bf16 computed in fp32 and rounded once). Bit-exact,
// including the mean's summation order (torch_sum, fk_decode_impl.h) and 1/sqrt as torch's rsqrt computes it.
// x, out: [rows, n] contiguous (out may alias x: a row is read whole before it is written); w: [n].
// Rows are independent, so a prompt's many rows are split over the kernel's threads (each row is
// computed the same way wherever it runs); a decode step's few rows stay on the calling thread.
FK_API int fk_rmsnorm_bf16(const uint16_t* x, const uint16_t* w, int64_t rows, int64_t n, float eps, uint16_t* out) {
  if (rows < 0 || n < 1) return fail("rmsnorm: rows must be >= 0 and n >= 1");
  if (!x || !w || !out) return fail("rmsnorm: null pointer");
  const NormRows ctx{x, w, nullptr, n, eps, out, nullptr, fk::current_isa()};
  fk::parallel_for(rows * n >= (int64_t(1) << 17) ? 0 : 1, rows, norm_rows, &ctx);
  return 0;
}

// out[r] = fp32(h * 1/sqrt(mean(h^2) + eps)) * w, h = float(x[r]), w fp32: fiddler.model.rms_norm_f32 (torch's
// F.rms_norm of x.float() with an fp32 weight), bit-exact, the mean and 1/sqrt as fk_rmsnorm_bf16's; the input
// of the quantized projections. x bf16 [rows, n], out fp32 [rows, n]; rows split over threads as there.
FK_API int fk_rmsnorm_f32(const uint16_t* x, const float* w, int64_t rows, int64_t n, float eps, float* out) {
  if (rows < 0 || n < 1) return fail("rmsnorm_f32: rows must be >= 0 and n >= 1");
  if (!x || !w || !out) return fail("rmsnorm_f32: null pointer");
  const NormRows ctx{x, nullptr, w, n, eps, nullptr, out, fk::current_isa()};
  fk::parallel_for(rows * n >= (int64_t(1) << 17) ? 0 : 1, rows, norm_rows, &ctx);
  return 0;
}

namespace {

// Rope + cache write + attention for B rows, row b's new token at position pos[b] of cache row rows[b]
// (the two entry points below). Every (row, head) is computed alone, by the same code whatever B is,
// the rows' order or the thread split: a sequence's results do not depend on its batch.
int rope_attn_rows(const uint16_t* qkv, int64_t B, int64_t nh, int64_t nkv, int64_t d, const int64_t* pos,
                   const int64_t* rows, const uint16_t* cos, const uint16_t* sin, uint16_t* kcache,
                   uint16_t* vcache, int64_t max_batch, int64_t max_seq, int64_t window, float scale,
                   uint16_t* out) {
  if (!qkv || !cos || !sin || !kcache || !vcache || !out || !pos || !rows) return fail("rope_attn_decode: null pointer");
  if (B < 1 || B > max_batch) return fail("rope_attn_decode: need 1 <= B <= max_batch");
  if (nh < 1 || nkv < 1 || nh % nkv) return fail("rope_attn_decode: num_heads must be a positive multiple of num_kv_heads");
  if (d < 2 || d % 2) return fail("rope_attn_decode: head_dim must be even and >= 2");
  for (int64_t b = 0; b < B; ++b) {
    if (pos[b] < 0 || pos[b] >= max_seq) return fail("rope_attn_decode: pos must be in [0, max_seq)");
    if (rows[b] < 0 || rows[b] >= max_batch) return fail("rope_attn_decode: cache row must be in [0, max_batch)");
  }
  const int64_t width = (nh + 2 * nkv) * d, row_elems = nkv * max_seq * d;
  const int isa = fk::current_isa();
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) {
    const uint16_t *cr = cos + pos[b] * d, *sr = sin + pos[b] * d, *q = qkv + b * width;
    uint16_t *kc = kcache + rows[b] * row_elems, *vc = vcache + rows[b] * row_elems;
    switch (isa) {
#if defined(__x86_64__)
      case fk::kIsaAvx512Bf16: avx512::write_kv(q, 1, nh, nkv, d, pos[b], cr, sr, kc, vc, max_seq); break;
      case fk::kIsaAvx512F:
      case fk::kIsaAvx2: avx2::write_kv(q, 1, nh, nkv, d, pos[b], cr, sr, kc, vc, max_seq); break;
#endif
      default: generic::write_kv(q, 1, nh, nkv, d, pos[b], cr, sr, kc, vc, max_seq);
    }
    const int64_t j0 = window > 0 && pos[b] + 1 > window ? pos[b] + 1 - window : 0;
    work += nh * (pos[b] + 1 - j0) * d;
  }
  // Query heads over the kernel's thread pool: a single thread would leave the other cores idle
  // between two weight streams (about 70 us a layer at 150 positions); tiny work stays on one.
  struct Ctx {
    const uint16_t *qkv, *cos, *sin, *kc, *vc;
    const int64_t *pos, *rows;
    int64_t nh, nkv, d, width, row_elems, max_seq, window;
    float scale;
    uint16_t* out;
    int isa;
  } ctx{qkv, cos, sin, kcache, vcache, pos, rows, nh, nkv, d, width, row_elems, max_seq, window, scale, out, isa};
  auto run = [](const void* p, int64_t h0, int64_t h1) {
    const Ctx& c = *static_cast<const Ctx*>(p);
    thread_local std::vector<float> sc;
    const size_t need = size_t(c.max_seq + 3 * c.d);
    if (sc.size() < need) sc.resize(need);
    for (int64_t b = h0 / c.nh; b * c.nh < h1; ++b) {  // the heads of row b within [h0, h1)
      const int64_t a = std::max(h0, b * c.nh) - b * c.nh, e = std::min(h1, (b + 1) * c.nh) - b * c.nh;
      const int64_t ps = c.pos[b], j0 = c.window > 0 && ps + 1 > c.window ? ps + 1 - c.window : 0;
      const uint16_t *q = c.qkv + b * c.width, *cr = c.cos + ps * c.d, *sr = c.sin + ps * c.d;
      const uint16_t *kc = c.kc + c.rows[b] * c.row_elems, *vc = c.vc + c.rows[b] * c.row_elems;
      uint16_t* o = c.out + b * c.nh * c.d;
      switch (c.isa) {
#if defined(__x86_64__)
        case fk::kIsaAvx512Bf16: avx512::attend_heads(q, c.nh, c.nkv, c.d, ps, cr, sr, kc, vc, c.max_seq, j0, c.scale, o, a, e, sc.data()); break;
        case fk::kIsaAvx512F:
        case fk::kIsaAvx2: avx2::attend_heads(q, c.nh, c.nkv, c.d, ps, cr, sr, kc, vc, c.max_seq, j0, c.scale, o, a, e, sc.data()); break;
#endif
        default: generic::attend_heads(q, c.nh, c.nkv, c.d, ps, cr, sr, kc, vc, c.max_seq, j0, c.scale, o, a, e, sc.data());
      }
    }
  };
  fk::parallel_for(work >= (int64_t(1) << 15) ? 0 : 1, B * nh, run, &ctx);
  return 0;
}

}  // namespace

// One decode step of attention for B sequences (one new token each, at position `pos`):
//   qkv   [B, (nh + 2*nkv) * d] bf16: the fused projection output, per row q heads, k heads, v heads
//   cos, sin [>= pos+1, d] bf16 rope tables (row `pos` is used)
//   kcache, vcache [max_batch, nkv, max_seq, d] bf16: one layer of the KV cache; row b < B is written
//          at `pos` (k after rope, v as is) and read over the attended positions
//   window: sliding window (<= 0: none); with one, keys j <= pos - window are masked (as
//          fiddler.model._attention does when pos + 1 > window)
//   out   [B, nh * d] bf16: softmax((q.k) * scale) @ v per head, the layout o_proj reads
// Rope is bit-exact against torch's bf16 ops (q*cos and rotate_half(q)*sin each rounded to bf16,
// their fp32 sum rounded to bf16), so the cache contents are too. Attention: fp32 scores from the bf16
// q and k, fp32 softmax, torch's flash-attention structure (fk_decode_impl.h); not bit-exact.
FK_API int fk_rope_attn_decode_bf16(const uint16_t* qkv, int64_t B, int64_t nh, int64_t nkv, int64_t d,
                                    int64_t pos, const uint16_t* cos, const uint16_t* sin, uint16_t* kcache,
                                    uint16_t* vcache, int64_t max_batch, int64_t max_seq, int64_t window,
                                    float scale, uint16_t* out) {
  if (B < 1 || B > max_batch) return fail("rope_attn_decode: need 1 <= B <= max_batch");
  std::vector<int64_t> p(size_t(B), pos), r(static_cast<size_t>(B), 0);
  for (int64_t b = 0; b < B; ++b) r[size_t(b)] = b;
  return rope_attn_rows(qkv, B, nh, nkv, d, p.data(), r.data(), cos, sin, kcache, vcache, max_batch, max_seq,
                        window, scale, out);
}

// The same for B sequences each at its own position pos[b], written to and read from cache row rows[b]
// (continuous batching: fiddler.batch's slots). Row b's results are bit-identical to a one-row call at
// pos[b] on that cache row. The rows must be distinct.
FK_API int fk_rope_attn_decode_rows_bf16(const uint16_t* qkv, int64_t B, int64_t nh, int64_t nkv, int64_t d,
                                         const int64_t* pos, const int64_t* rows, const uint16_t* cos,
                                         const uint16_t* sin, uint16_t* kcache, uint16_t* vcache, int64_t max_batch,
                                         int64_t max_seq, int64_t window, float scale, uint16_t* out) {
  return rope_attn_rows(qkv, B, nh, nkv, d, pos, rows, cos, sin, kcache, vcache, max_batch, max_seq, window,
                        scale, out);
}

namespace {
// Qwen3's per-head q and k RMSNorms on the projection's output, in place (null norms: none): row b's nh query
// heads and nkv key heads are rows of head_dim, normalised by fk_rmsnorm_bf16, i.e. bit-exact with
// fiddler.model's _qk_norm_clip (rms_norm over each head).
int head_norms(uint16_t* qkv, int64_t B, int64_t nh, int64_t nkv, int64_t d, const uint16_t* q_norm,
               const uint16_t* k_norm, float eps) {
  if (!q_norm && !k_norm) return 0;
  if (!q_norm || !k_norm) return fail("decode_attn_block: q_norm and k_norm come together");
  const int64_t width = (nh + 2 * nkv) * d;
  for (int64_t b = 0; b < B; ++b) {
    uint16_t* q = qkv + b * width;
    int rc = fk_rmsnorm_bf16(q, q_norm, nh, d, eps, q);
    if (rc == 0) rc = fk_rmsnorm_bf16(q + nh * d, k_norm, nkv, d, eps, q + nh * d);
    if (rc != 0) return rc;
  }
  return 0;
}
}  // namespace

// The attention half of one decoder layer's decode step for B rows (row b: position pos[b], cache row
// rows[b]), and the MoE half's inputs, in one call instead of seven (fiddler.model's fused decode
// layer): h = rms_norm(x, norm1); qkv = h @ Wqkv^T (+ bias), then Qwen3's per-head q/k norms where q_norm and
// k_norm [head_dim] are given (else null); att = rope + cache write + attention;
// o = att @ Wo^T (+ bias); x_out = bf16(x + o); h2 = rms_norm(x_out, norm2); logits = h2 @ Wrouter^T.
// Each step is the very function its own entry point runs (fk_rmsnorm_bf16, fk_linear,
// fk_rope_attn_decode_rows_bf16) on the same buffers, and the residual add rounds fp32(x + o) to bf16 as
// torch's bf16 add does, so every output is bit-identical to those calls made one by one.
// Packed weights as fk_linear takes them (qkv: [(nh + 2 nkv) d, hidden], o: [hidden, nh d], router:
// [n_experts, hidden]; null with n_experts 0 for a dense layer: no logits); biases fp32 or null. Scratch h [B, hidden], qkv [B, (nh + 2 nkv) d], att and o;
// outputs x_out [B, hidden] (not aliasing x), h2 [B, hidden], logits [B, n_experts] bf16.
FK_API int fk_decode_attn_block_bf16(const uint16_t* x, int64_t B, int64_t hidden, const uint16_t* norm1, const uint16_t* norm2, float eps, const void* qkv_w, const float* qkv_bias, const uint16_t* q_norm, const uint16_t* k_norm, const void* o_w, const float* o_bias, const void* router_w, int64_t n_experts, int64_t nh, int64_t nkv, int64_t d, const int64_t* pos, const int64_t* rows, const uint16_t* cos, const uint16_t* sin, uint16_t* kcache, uint16_t* vcache, int64_t max_batch, int64_t max_seq, int64_t window, float scale, uint16_t* h, uint16_t* qkv, uint16_t* att, uint16_t* o, uint16_t* x_out, uint16_t* h2, uint16_t* logits, int threads) {
  if (!x || !x_out || !h2 || !h || !o || !att || !qkv || !qkv_w || !o_w || !norm1 || !norm2 ||
      (n_experts > 0 && (!router_w || !logits)))
    return fail("decode_attn_block: null pointer");
  if (x_out == x) return fail("decode_attn_block: x_out must not alias x");
  if (B < 1 || hidden < 1 || n_experts < 0) return fail("decode_attn_block: need B, hidden >= 1, n_experts >= 0");
  const int64_t width = (nh + 2 * nkv) * d;
  int rc = fk_rmsnorm_bf16(x, norm1, B, hidden, eps, h);
  if (rc == 0) rc = fk::linear(qkv_w, width, hidden, h, B, qkv_bias, qkv, false, threads);
  if (rc == 0) rc = head_norms(qkv, B, nh, nkv, d, q_norm, k_norm, eps);
  if (rc == 0)
    rc = rope_attn_rows(qkv, B, nh, nkv, d, pos, rows, cos, sin, kcache, vcache, max_batch, max_seq, window, scale, att);
  if (rc == 0) rc = fk::linear(o_w, hidden, nh * d, att, B, o_bias, o, false, threads);
  if (rc != 0) return rc;
  for (int64_t i = 0; i < B * hidden; ++i) x_out[i] = generic::st(generic::ld(x[i]) + generic::ld(o[i]));
  rc = fk_rmsnorm_bf16(x_out, norm2, B, hidden, eps, h2);
  if (rc == 0 && n_experts > 0) rc = fk::linear(router_w, n_experts, hidden, h2, B, nullptr, logits, false, threads);
  return rc;
}

// fk_decode_attn_block_bf16 for quantized projections (fmt: 0 = Q8_0, 1 = Q4_0, as fk_qlinear), the model's
// llama.cpp-like fp32 activations (MoETransformer.fp32_quant_acts): h = rms_norm_f32(x, norm1) (fp32);
// qkv = fk_qlinear(qkv_w, h fp32) (+ the per-head q/k norms, bf16, as there); att = rope + cache write + attention; o = fk_qlinear(o_w, att bf16);
// x_out = bf16(x + o); h2 = rms_norm_f32(x_out, norm2) (fp32, the router's and the experts' input). Each step
// is the very function its own entry point runs, on the same buffers, so every output is bit-identical to
// those calls made one by one. The fp32 router stays with the caller. No biases (quantized attention has none).
FK_API int fk_decode_attn_block_q(int fmt, const uint16_t* x, int64_t B, int64_t hidden, const float* norm1, const float* norm2, float eps, const void* qkv_w, const uint16_t* q_norm, const uint16_t* k_norm, const void* o_w, int64_t nh, int64_t nkv, int64_t d, const int64_t* pos, const int64_t* rows, const uint16_t* cos, const uint16_t* sin, uint16_t* kcache, uint16_t* vcache, int64_t max_batch, int64_t max_seq, int64_t window, float scale, float* h, uint16_t* qkv, uint16_t* att, uint16_t* o, uint16_t* x_out, float* h2, int threads) {
  if (!x || !x_out || !h2 || !h || !o || !att || !qkv || !qkv_w || !o_w || !norm1 || !norm2)
    return fail("decode_attn_block_q: null pointer");
  if (x_out == x) return fail("decode_attn_block_q: x_out must not alias x");
  if (B < 1 || hidden < 1) return fail("decode_attn_block_q: need B, hidden >= 1");
  const int64_t width = (nh + 2 * nkv) * d;
  int rc = fk_rmsnorm_f32(x, norm1, B, hidden, eps, h);
  if (rc == 0) rc = fk::qlinear(fmt, qkv_w, width, hidden, h, true, B, nullptr, qkv, false, threads);
  if (rc == 0) rc = head_norms(qkv, B, nh, nkv, d, q_norm, k_norm, eps);
  if (rc == 0)
    rc = rope_attn_rows(qkv, B, nh, nkv, d, pos, rows, cos, sin, kcache, vcache, max_batch, max_seq, window, scale, att);
  if (rc == 0) rc = fk::qlinear(fmt, o_w, hidden, nh * d, att, false, B, nullptr, o, false, threads);
  if (rc != 0) return rc;
  for (int64_t i = 0; i < B * hidden; ++i) x_out[i] = generic::st(generic::ld(x[i]) + generic::ld(o[i]));
  return fk_rmsnorm_f32(x_out, norm2, B, hidden, eps, h2);
}

// y = bf16(residual + moe) with moe = fk_moe_ffn(...) of the same arguments: the executor's decode row and
// the model's residual add in one call (torch's bf16 add: fp32 sum rounded once), bit-identical to the
// two. y [tokens, hidden] may not alias x or residual.
FK_API int fk_moe_ffn_residual_bf16(const void* const* p13, const void* const* p2, const uint16_t* w, int n_experts, int64_t hidden, int64_t ffn, const uint16_t* x, const uint16_t* residual, int64_t tokens, uint16_t* y, int threads) {
  if (!residual || !y) return fail("moe_ffn_residual: null pointer");
  if (y == x || y == residual) return fail("moe_ffn_residual: y must not alias x or residual");
  const int rc = fk::moe_ffn(p13, p2, w, n_experts, hidden, ffn, x, tokens, y, threads);
  if (rc != 0) return rc;
  for (int64_t i = 0; i < tokens * hidden; ++i) y[i] = generic::st(generic::ld(residual[i]) + generic::ld(y[i]));
  return 0;
}

// Weight packing and the blocked drivers: the expert FFN, a decode step's MoE block and a plain
// linear layer. They cut the work into 32-row weight blocks, share the blocks over the thread pool
// and call the active ISA path's micro-kernel (IsaOps) for each block and token group.
#include <cstring>

#include <sys/mman.h>

#include "fk_internal.h"

namespace fk {
namespace {

template <class T>
T* scratch(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}
thread_local std::vector<float> t_acc;      // per thread: [groups][rows][kBlockN] fp32 accumulators
thread_local std::vector<uint16_t> t_x;     // per caller: padded copy of x
thread_local std::vector<uint16_t> t_h;     // per caller: expert hidden activations
thread_local std::vector<uint16_t> t_y;     // per caller: per-expert outputs (fk_moe_ffn)


struct Plan {
  const IsaOps* ops;
  bool amx;
  int64_t rows;  // token rows computed (T, or T rounded up to 16 for AMX)
};

Plan make_plan(int64_t tokens) {
  Plan p{&vector_ops(current_isa()), false, tokens};
  const int amx = amx_mode();
  if (amx != kAmxOff && tokens >= amx_min_tokens()) {
#if defined(__x86_64__)
    p.ops = amx == kAmxHw ? &kAmxOps : &kAmxEmuOps;
#else
    p.ops = &kAmxEmuOps;
#endif
    p.amx = true;
    p.rows = round_up(tokens, 16);
  }
  return p;
}

// x as the micro-kernels need it: K padded to Kp with zeros, rows padded for AMX. Copies only when
// needed (a Mixtral-shaped call uses the caller's tensor as is).
const uint16_t* prepare_x(const uint16_t* x, int64_t tokens, int64_t k, int64_t rows, int64_t kp,
                          int64_t* ldx) {
  if (k == kp && rows == tokens) {
    *ldx = k;
    return x;
  }
  uint16_t* buf = scratch(t_x, size_t(rows * kp));
  std::memset(buf, 0, size_t(rows * kp) * 2);
  for (int64_t t = 0; t < tokens; ++t) std::memcpy(buf + t * kp, x + t * k, size_t(k) * 2);
  *ldx = kp;
  return buf;
}

// acc[g][rows][kBlockN] = x[rows][:] . W_g[block nb]^T for each of the `groups` interleaved matrices.
void block_product(const Plan& p, const uint8_t* packed, int groups, int64_t k_pad, int64_t nb,
                   const uint16_t* x, int64_t ldx, float* acc) {
  const int64_t bb = block_bytes(k_pad);
  const int mr = p.ops->mr;
  const int64_t n_groups_t = (p.rows + mr - 1) / mr;
  for (int g = 0; g < groups; ++g) {
    const uint8_t* blk = packed + (nb * groups + g) * bb;
    float* ag = acc + g * p.rows * kBlockN;
    for (int64_t k0 = 0; k0 < k_pad; k0 += kChunkK) {
      const int64_t kpairs = std::min(kChunkK, k_pad - k0) / 2;
      const char* wk = reinterpret_cast<const char*>(blk + k0 / 2 * kBlockN * 4);
      // With several token groups the chunk is reused from L2 and the work is compute-bound, so
      // each group also pulls its share of the next chunk (the following bytes of the stream) into
      // cache: DRAM time hides under compute. Token groups have near-equal sizes (AMX: 32/16 rows,
      // rows a multiple of 16).
      const int64_t chunk_lines = kpairs * kBlockN * 4 / 64;
      const int64_t pf_lines = n_groups_t > 1 ? (chunk_lines + n_groups_t - 1) / n_groups_t : 0;
      for (int64_t gi = 0, t0 = 0; t0 < p.rows; ++gi) {
        int64_t m;
        if (p.amx) m = std::min<int64_t>(32, p.rows - t0);
        else m = (p.rows - t0 + (n_groups_t - gi) - 1) / (n_groups_t - gi);
        p.ops->mk(reinterpret_cast<const uint16_t*>(wk), kpairs, x + t0 * ldx + k0, ldx, int(m),
                  ag + t0 * kBlockN, k0 > 0, wk + 64 * (chunk_lines + gi * pf_lines), pf_lines);
        t0 += m;
      }
    }
  }
}

template <class Epilogue>
void run_blocks(const Plan& p, const uint8_t* packed, int groups, int64_t n_blocks,
                int64_t k_pad, const uint16_t* x, int64_t ldx, int threads,
                const Epilogue& epi) {
  pool().run(threads, n_blocks, 1, [&](int64_t b0, int64_t b1) {
    float* acc = scratch(t_acc, size_t(groups * p.rows * kBlockN));
    for (int64_t nb = b0; nb < b1; ++nb) {
      block_product(p, packed, groups, k_pad, nb, x, ldx, acc);
      epi(nb, acc);
    }
  });
}

}  // namespace

int64_t packed_bytes(int64_t n, int64_t k, int groups) {
  if (n <= 0 || k <= 0 || groups <= 0) return -1;
  return round_up(n, kBlockN) / kBlockN * groups * block_bytes(round_up(k, kAlignK));
}

// Best-effort: back a large buffer (before it is first written) with transparent huge pages,
// which removes most TLB misses from a weight stream of hundreds of MB.
void advise_hugepages(void* p, int64_t nbytes) {
#if defined(MADV_HUGEPAGE)
  const uintptr_t huge = 2u << 20, a = (reinterpret_cast<uintptr_t>(p) + huge - 1) & ~(huge - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + uintptr_t(nbytes)) & ~(huge - 1);
  if (e > a) madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);
#else
  (void)p;
  (void)nbytes;
#endif
}

// Packs `groups` row-major bf16 matrices ws[g][n][k] into dst (fk_packed_bytes bytes, 64-byte aligned).
int pack(const uint16_t* const* ws, int groups, int64_t n, int64_t k, void* dst, int threads) {
  const int64_t bytes = packed_bytes(n, k, groups);
  if (bytes < 0 || !dst || !ws) return fail("fk_pack: bad arguments");
  if (reinterpret_cast<uintptr_t>(dst) % 64) return fail("fk_pack: destination is not 64-byte aligned");
  const int64_t k_pad = round_up(k, kAlignK), n_blocks = round_up(n, kBlockN) / kBlockN;
  const int64_t bb = block_bytes(k_pad);
  const int nt = thread_count(threads, n_blocks, bytes, 1);
  pool().run(nt, n_blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int g = 0; g < groups; ++g) {
        uint16_t* blk = reinterpret_cast<uint16_t*>(static_cast<uint8_t*>(dst) + (nb * groups + g) * bb);
        std::memset(blk, 0, size_t(bb));
        for (int r = 0; r < kBlockN; ++r) {
          const int64_t row = nb * kBlockN + r;
          if (row >= n) break;
          const uint16_t* src = ws[g] + row * k;
          uint16_t* d = blk + 2 * r;
          int64_t c = 0;
          for (; c + 1 < k; c += 2, d += 2 * kBlockN) std::memcpy(d, src + c, 4);  // one column pair
          if (c < k) *d = src[c];
        }
      }
  });
  return 0;
}

// y[tokens][hidden] = W2 (silu(W1 x) * (W3 x)); p13 packs {W1, W3} (groups = 2, [ffn][hidden]),
// p2 packs W2 ([hidden][ffn]). Inputs/outputs bf16, fp32 accumulation, h rounded to bf16 once.
int expert_ffn(const void* p13, const void* p2, int64_t hidden, int64_t ffn,
                         const uint16_t* x, int64_t tokens, uint16_t* y, int threads) {
  if (!p13 || !p2 || !x || !y || hidden <= 0 || ffn <= 0 || tokens <= 0)
    return fail("expert_ffn: bad arguments");
  const Plan p = make_plan(tokens);
  const int64_t kp_h = round_up(hidden, kAlignK), kp_f = round_up(ffn, kAlignK);
  const int64_t nb_f = round_up(ffn, kBlockN) / kBlockN, nb_h = round_up(hidden, kBlockN) / kBlockN;
  const int64_t ldh = nb_f * kBlockN;  // >= kp_f; padded columns come out as silu(0) * 0 = 0
  int64_t ldx;
  const uint16_t* xp = prepare_x(x, tokens, hidden, p.rows, kp_h, &ldx);
  uint16_t* h = scratch(t_h, size_t(p.rows * ldh));
  const auto* w13 = static_cast<const uint8_t*>(p13);
  const auto* w2 = static_cast<const uint8_t*>(p2);

  run_blocks(p, w13, 2, nb_f, kp_h, xp, ldx, thread_count(threads, nb_f, 2 * nb_f * block_bytes(kp_h), tokens),
             [&](int64_t nb, const float* acc) {
               const float* a1 = acc;
               const float* a3 = acc + p.rows * kBlockN;
               for (int64_t t = 0; t < p.rows; ++t)
                 p.ops->silu_mul(a1 + t * kBlockN, a3 + t * kBlockN, kBlockN, h + t * ldh + nb * kBlockN);
             });
  run_blocks(p, w2, 1, nb_h, kp_f, h, ldh, thread_count(threads, nb_h, nb_h * block_bytes(kp_f), tokens),
             [&](int64_t nb, const float* acc) {
               const int64_t n = std::min<int64_t>(kBlockN, hidden - nb * kBlockN);
               for (int64_t t = 0; t < tokens; ++t)
                 p.ops->store(acc + t * kBlockN, nullptr, n, y + t * hidden + nb * kBlockN, false);
             });
  return 0;
}

// The MoE block of one decode step on the CPU: y = sum_e bf16(bf16(FFN_e(x)) * w_e) over n_experts
// experts that all see the same rows x[tokens][hidden] (fp32 sum, rounded to bf16 once) -- the
// roundings of the executor's torch combine (slots = y * w; slots.sum(1)), so results are unchanged.
// One call instead of one per expert: the gate/up pass of every expert is one pooled region and
// the down pass of every expert another, so a layer has 2 barriers instead of 2 per expert and no
// Python between experts. p13[e], p2[e]: packed weights as for fk_expert_ffn; w: bf16 [n_experts].
int moe_ffn(const void* const* p13, const void* const* p2, const uint16_t* w, int n_experts,
                      int64_t hidden, int64_t ffn, const uint16_t* x, int64_t tokens, uint16_t* y,
                      int threads) {
  if (!p13 || !p2 || !w || !x || !y || n_experts <= 0 || hidden <= 0 || ffn <= 0 || tokens <= 0)
    return fail("moe_ffn: bad arguments");
  for (int e = 0; e < n_experts; ++e)
    if (!p13[e] || !p2[e]) return fail("moe_ffn: null expert weights");
  const Plan p = make_plan(tokens);
  const int64_t kp_h = round_up(hidden, kAlignK), kp_f = round_up(ffn, kAlignK);
  const int64_t nb_f = round_up(ffn, kBlockN) / kBlockN, nb_h = round_up(hidden, kBlockN) / kBlockN;
  const int64_t ldh = nb_f * kBlockN, h_stride = p.rows * ldh;
  int64_t ldx;
  const uint16_t* xp = prepare_x(x, tokens, hidden, p.rows, kp_h, &ldx);
  uint16_t* h = scratch(t_h, size_t(n_experts * h_stride));
  const int64_t items1 = n_experts * nb_f;
  pool().run(thread_count(threads, items1, 2 * items1 * block_bytes(kp_h), tokens), items1, 1,
             [&](int64_t i0, int64_t i1) {
               float* acc = scratch(t_acc, size_t(2 * p.rows * kBlockN));
               for (int64_t i = i0; i < i1; ++i) {
                 const int64_t e = i / nb_f, nb = i % nb_f;
                 block_product(p, static_cast<const uint8_t*>(p13[e]), 2, kp_h, nb, xp, ldx, acc);
                 uint16_t* he = h + e * h_stride;
                 for (int64_t t = 0; t < p.rows; ++t)
                   p.ops->silu_mul(acc + t * kBlockN, acc + (p.rows + t) * kBlockN, kBlockN,
                                   he + t * ldh + nb * kBlockN);
               }
             });
  // Down passes: items are (expert, block) in expert-major order, so each thread streams contiguous
  // weight ranges and the last item of the region is one 32-row block of one expert (a short tail).
  // Each expert's output is rounded to bf16 as it is stored; the weighted sum follows the region.
  uint16_t* ye = scratch(t_y, size_t(n_experts * tokens * hidden));
  const int64_t items2 = n_experts * nb_h;
  pool().run(thread_count(threads, items2, items2 * block_bytes(kp_f), tokens), items2, 1,
             [&](int64_t i0, int64_t i1) {
               float* acc = scratch(t_acc, size_t(p.rows * kBlockN));
               for (int64_t i = i0; i < i1; ++i) {
                 const int64_t e = i / nb_h, nb = i % nb_h;
                 block_product(p, static_cast<const uint8_t*>(p2[e]), 1, kp_f, nb, h + e * h_stride, ldh, acc);
                 const int64_t n = std::min<int64_t>(kBlockN, hidden - nb * kBlockN);
                 for (int64_t t = 0; t < tokens; ++t)
                   p.ops->store(acc + t * kBlockN, nullptr, n, ye + (e * tokens + t) * hidden + nb * kBlockN, false);
               }
             });
  combine_experts(ye, w, n_experts, tokens * hidden, y);
  return 0;
}

void combine_experts(const uint16_t* ye, const uint16_t* w, int n_experts, int64_t count, uint16_t* y) {
  if (n_experts == 1 && w[0] == 0x3f80) {  // one expert at weight 1.0: the products and the sum are exact
    std::memcpy(y, ye, size_t(count) * 2);
    return;
  }
  for (int64_t i = 0; i < count; ++i) {
    float sum = 0.0f;
    for (int e = 0; e < n_experts; ++e)
      sum += bf16_to_f32(f32_to_bf16(bf16_to_f32(ye[e * count + i]) * bf16_to_f32(w[e])));
    y[i] = f32_to_bf16(sum);
  }
}

// y[tokens][n] = x[tokens][k] . W^T (+ bias), W packed with groups = 1; y bf16 or fp32.
int linear(const void* packed, int64_t n, int64_t k, const uint16_t* x, int64_t tokens,
                     const float* bias, void* y, bool out_f32, int threads) {
  if (!packed || !x || !y || n <= 0 || k <= 0 || tokens <= 0) return fail("linear: bad arguments");
  const Plan p = make_plan(tokens);
  const int64_t kp = round_up(k, kAlignK), n_blocks = round_up(n, kBlockN) / kBlockN;
  const size_t es = out_f32 ? 4 : 2;
  int64_t ldx;
  const uint16_t* xp = prepare_x(x, tokens, k, p.rows, kp, &ldx);
  run_blocks(p, static_cast<const uint8_t*>(packed), 1, n_blocks, kp, xp, ldx,
             thread_count(threads, n_blocks, n_blocks * block_bytes(kp), tokens),
             [&](int64_t nb, const float* acc) {
               const int64_t nv = std::min<int64_t>(kBlockN, n - nb * kBlockN);
               for (int64_t t = 0; t < tokens; ++t)
                 p.ops->store(acc + t * kBlockN, bias ? bias + nb * kBlockN : nullptr, nv,
                              static_cast<char*>(y) + (t * n + nb * kBlockN) * es, out_f32);
             });
  return 0;
}

}  // namespace fk

// The router's top-k of a few rows of fp32 expert scores (a decode step's softmax output), with the
// renormalisation and the bf16 rounding fiddler.model.route applies after torch.topk: one call in place
// of four torch ops a layer (fiddler/kernels/route.py binds it).
//
// Bit-identical to torch by construction, not by imitation of its sort: a row is served only when its top
// k are unambiguous (k values strictly decreasing and strictly above every other score, no NaN), where
// any correct top-k gives the same ids in the same order; otherwise the call returns 1 and the caller runs
// torch.topk (whose order among equal scores is its own). The renormalisation divides by the sum of the
// top k, which for k <= 2 is one fp32 addition (the same in any order), so a renormalised call takes
// k <= 2 only; the division and the round to bf16 (nearest even) are IEEE operations (no fast-math here).
#include <cmath>

#include "fk.h"
#include "fk_api.h"
#include "fk_internal.h"

using namespace fk;

namespace {

// The k largest of s[0, n) in decreasing order into v/ix; false where they are not unambiguous.
bool top_k(const float* s, int64_t n, int64_t k, float* v, int64_t* ix) {
  int64_t have = 0;
  for (int64_t j = 0; j < n; ++j) {
    float x = s[j];
    if (std::isnan(x)) return false;
    if (have == k && !(x > v[k - 1])) continue;
    int64_t at = have < k ? have++ : k - 1;  // insertion point, from the end (ties: after, kept stable)
    while (at > 0 && x > v[at - 1]) {
      v[at] = v[at - 1];
      ix[at] = ix[at - 1];
      --at;
    }
    v[at] = x;
    ix[at] = j;
  }
  for (int64_t i = 1; i < k; ++i)
    if (!(v[i - 1] > v[i])) return false;  // two of the top k equal
  for (int64_t j = 0; j < n; ++j) {  // a score outside the top k equal to the k-th
    if (s[j] == v[k - 1] && j != ix[k - 1]) return false;
  }
  return true;
}

}  // namespace

FK_API int fk_route_topk_f32(const float* scores, int64_t rows, int64_t n_experts, int64_t k, int renorm,
                             int64_t* ids, uint16_t* weights) {
  constexpr int64_t kMaxK = 64;
  if (!scores || !ids || !weights || rows < 0 || n_experts < 1 || k < 1 || k > n_experts || k > kMaxK)
    return fail("fk_route_topk_f32: bad arguments (k must be in [1, min(n_experts, 64)])");
  if (renorm && k > 2) return fail("fk_route_topk_f32: a renormalised top-k takes k <= 2 (the sum's order)");
  float v[kMaxK];
  for (int64_t r = 0; r < rows; ++r) {
    int64_t* ix = ids + r * k;
    if (!top_k(scores + r * n_experts, n_experts, k, v, ix)) return 1;
    float sum = renorm ? (k == 2 ? v[0] + v[1] : v[0]) : 1.0f;
    for (int64_t i = 0; i < k; ++i) weights[r * k + i] = f32_to_bf16(renorm ? v[i] / sum : v[i]);
  }
  return 0;
}

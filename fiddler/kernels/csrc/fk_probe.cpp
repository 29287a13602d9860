// The memory-read bandwidth probe: the limit that judges the kernel. It must not share the kernel's
// tuning, so the caller names the read strategy (prefetch hint and distance, thread count) and
// fiddler.kernels.read_limit() takes the best of several strategies and of an fp32 GEMV.
#include "fk_internal.h"

namespace fk {

// Best-of-`repeats` GB/s of a streaming read of buf[0, nbytes) (64-byte aligned, larger than any
// cache) on `threads` threads with the widest loads this CPU has, prefetching `dist` bytes ahead
// with `hint` (kHintNone: plain loads).
double read_bandwidth(const void* buf, int64_t nbytes, int threads, int hint, int64_t dist, int repeats) {
  if (!buf || reinterpret_cast<uintptr_t>(buf) % 64) return fail("probe: buffer must be 64-byte aligned");
  if (hint < 0 || hint >= kNumHints) return fail("probe: unknown prefetch hint " + std::to_string(hint));
  if (dist < 0 || dist % 64) return fail("probe: prefetch distance must be a multiple of 64");
  const int n = threads > 0 ? threads : default_threads();
  const int64_t piece = nbytes / (int64_t(n) * 16) / 4096 * 4096;  // 16 pieces a thread, 4 KiB multiples
  if (piece <= 0) return fail("probe: buffer too small for " + std::to_string(n) + " threads");
  const IsaOps& ops = vector_ops(best_isa());
  std::atomic<uint64_t> sink{0};
  double best = 0;
  for (int r = 0; r < std::max(1, repeats); ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    // pieces claimed dynamically, so a thread the OS did not schedule delays nothing
    pool().run(n, int64_t(n) * 16, 1, [&](int64_t b, int64_t e) {
      sink.fetch_xor(ops.read(static_cast<const char*>(buf) + b * piece, (e - b) * piece, hint, dist),
                     std::memory_order_relaxed);
    });
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, double(piece * n * 16) / dt / 1e9);
  }
  return best + 0.0 * double(sink.load() & 1);  // the sink keeps the reads alive
}

}  // namespace fk

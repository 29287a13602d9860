// The kernel's persistent thread pool (class Pool in fk_internal.h) and parallel_for.
#include <pthread.h>

#include "fk_internal.h"

namespace fk {

void Pool::loop() {
  uint64_t seen = state_.load(std::memory_order_acquire) >> 32;
  for (;;) {
    // spin for g_spin_us, yielding to other runnable threads every few microseconds
    auto changed = [&] { return (state_.load(std::memory_order_acquire) >> 32) != seen; };
    if (!changed()) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto spin = std::chrono::microseconds(spin_us());
      for (int i = 1; !changed(); ++i) {
        cpu_relax();
        if ((i & 255) == 0) {
          const auto dt = std::chrono::steady_clock::now() - t0;
          if (dt > spin) break;
          if ((i & 4095) == 0) sched_yield();
        }
      }
    }
    if (!changed()) {
      std::unique_lock<std::mutex> lk(mu_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      cv_.wait(lk, changed);
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
    }
    seen = state_.load(std::memory_order_acquire) >> 32;
    if (join(seen)) {
      work(job_);
      state_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
}

int Pool::spin_us() {
  static const int us = [] {
    const char* e = getenv("FIDDLER_KERNEL_SPIN_US");
    return e ? std::max(0, atoi(e)) : 100;
  }();
  return us;
}

// Never destroyed: workers block forever, so there is no join at exit. A forked child has none of
// the parent's workers, and the parent's mutexes and condition variable may have been caught in
// use (a sleeping worker makes notify_all wait for it forever), so the child starts a fresh pool
// and leaks the old one.
Pool* g_pool = nullptr;
Pool& pool() {
  static const bool once = [] {
    g_pool = new Pool;
    pthread_atfork(nullptr, nullptr, [] { g_pool = new Pool; });
    return true;
  }();
  (void)once;
  return *g_pool;
}

// Threads for a region over `blocks` weight blocks of `weight_bytes` in total, for `tokens` tokens.
int thread_count(int requested, int64_t blocks, int64_t weight_bytes, int64_t tokens) {
  int n = requested > 0 ? requested : (default_threads());
  // below ~64 KiB of weights per thread (~8 tokens' worth of work per byte counted once per 8
  // tokens) the wake-up costs more than the split saves
  const int64_t work = weight_bytes * std::max<int64_t>(1, tokens / 8);
  n = int(std::min<int64_t>({int64_t(n), blocks, std::max<int64_t>(1, work >> 16)}));
  return std::max(1, n);
}

void parallel_for(int threads, int64_t items, void (*fn)(const void*, int64_t, int64_t), const void* ctx) {
  const int n = threads > 0 ? threads : (default_threads());
  pool().run(int(std::min<int64_t>(n, items)), items, 1, [&](int64_t b, int64_t e) { fn(ctx, b, e); });
}

}  // namespace fk

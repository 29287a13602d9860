// AMX-BF16 path: the AVX512-BF16 path with the micro-kernel replaced by tile instructions, used for
// token counts where the AVX-512 path is compute-bound. Only called after fk_api.cpp detected AMX and
// obtained the tile-data permission (arch_prctl) for the process.
#include <immintrin.h>

#include "fk.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace fk {

namespace {
#define TILE_CONFIG(cfg) load_tile_config(cfg)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, p, s) _tile_loadd(t, p, s)
#define TILE_STORE(t, p, s) _tile_stored(t, p, s)
#define TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define TILE_RELEASE() _tile_release()
#include "fk_amx_impl.h"
}  // namespace

extern const IsaOps kAmxOps = {"amx", 32, amx_mk, silu_mul_avx512_bf16, store_avx512_bf16,
                               read_avx512, amx_done};

}  // namespace fk

#pragma GCC pop_options
#endif  // __x86_64__

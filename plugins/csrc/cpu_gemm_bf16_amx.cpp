// The bf16 GEMM's AMX path (Intel AMX-BF16: Sapphire Rapids and later), reading the same 48-channel
// panels as the AVX512-BF16 path (cpu_gemm_bf16.cpp's header), so the packing does not depend on it.
//
// Why: on an AMX host vdpbf16ps is the slow way to multiply bf16. Measured on a 2-core Xeon with
// AMX (30 layers of SmolLM2's linears from memory, 2 threads, one process): the AVX512-BF16 panels
// reached 109-113 GFLOP/s at 64-1024 rows, oneDNN's GEMM (which uses AMX) 460-582.
//
// How the layout maps onto tiles: a panel row j holds, for each of its 48 channels, the pair
// (w[n][2j], w[n][2j+1]) as one 32-bit word: exactly the "VNNI" order of an AMX B tile, 16 K-pairs
// x 16 channels = 16 rows of 64 bytes. So B tile t of K step s is a strided load of the panel:
// base panel + 16 s rows + 16 t words, 192 bytes (48 words) between rows. An A tile is 16 rows x
// 32 bf16 of the activations (stride 2 K bytes); C tiles hold 16 rows x 16 channels of fp32 sums.
// Blocking: C = 16 rows x 48 channels (tiles 0-2), A in tile 3, B in tiles 4-6; per K step of 32
// one A load, three B loads, three tdpbf16ps. A row block short of 16 rows is copied into a
// zero-padded scratch first. K must be a multiple of 32 (Bf16Gemm::run keeps the AVX512 path
// otherwise). Each call fetches the next task's panel into L2 over its K steps, as the AVX512 path
// does: 30 layers at 64 rows 40.7 -> 29.0 ms, the head 11.6 -> 7.3 (same process, two builds).
// Tried, not kept: 32-row blocks (6 C tiles, A and B reloaded into one tile each, so each B tile
// serves two row blocks): 64 rows 29.3 vs 25.2 ms, 1024 rows 364 vs 332; only the head gained. Sums: fp32 over K in AMX's order; the output rounds to bf16 to nearest even, as the
// AVX512 path does (results may differ from it in the last place, never between calls).
//
// The tile state: Linux hands it to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM),
// asked once; a refusal keeps the AVX512 path. Each thread loads the tile configuration at the start
// of its share of a GEMM and releases the tiles at the end (AmxTiles), so no thread keeps 8 KB of
// tile state live between GEMMs.

#include "cpu_gemm_bf16_amx.h"

#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define QKILN_AMX_BF16 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kPanel = 48;  // channels per panel (cpu_gemm_bf16.cpp)
constexpr int kTileRows = 16;

#ifdef QKILN_AMX_BF16
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool request_tile_state() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}
#endif

}  // namespace

bool amx_bf16_ready() {
#ifdef QKILN_AMX_BF16
  static const bool ready = request_tile_state();
  return ready;
#else
  return false;
#endif
}

AmxTiles::AmxTiles() {
#ifdef QKILN_AMX_BF16
  // Static, and a compiler barrier: GCC 12 treats _tile_loadconfig as not reading its operand and
  // dropped the stores of a local configuration (ldtilecfg then faulted on all-zero tiles).
  static const TileConfig cfg = [] {
    TileConfig c;
    // block16: 0-2 C, 3 A, 4-6 B; cpu_gemm_codes_amx.cpp: 0-3 C, 4-5 A, 6-7 B. All 16 x 64 bytes.
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = kTileRows;
      c.colsb[t] = 64;
    }
    return c;
  }();
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
#endif
}

AmxTiles::~AmxTiles() {
#ifdef QKILN_AMX_BF16
  _tile_release();
#endif
}

namespace {

#ifdef QKILN_AMX_BF16
// sums [16, 48] fp32 -> c rows [0, valid) x [0, ncols) as bf16, nearest even.
void store_rows(const float* sums, int64_t valid, c10::BFloat16* c, int64_t ldc, int64_t ncols) {
  for (int64_t r = 0; r < valid; ++r)
    for (int t = 0; t < 3 && t * 16 < ncols; ++t) {
      const __mmask16 keep = static_cast<__mmask16>((1u << std::min<int64_t>(16, ncols - t * 16)) - 1);
      const __m512 v = _mm512_load_ps(sums + r * kPanel + t * 16);
      _mm256_mask_storeu_epi16(c + r * ldc + t * 16, keep, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

// 16 rows of a (row stride K) x the panel -> sums [16, 48]: C tiles 0-2, A 3, B 4-6.
void block16(const uint16_t* a, int64_t K, const uint32_t* panel, float* sums, Ahead& ahead) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int64_t k = 0; k < K; k += 32) {
    ahead.step();
    const uint32_t* b = panel + (k / 2) * kPanel;
    _tile_loadd(3, a + k, K * sizeof(uint16_t));
    _tile_loadd(4, b, kPanel * 4);
    _tile_dpbf16ps(0, 3, 4);
    _tile_loadd(5, b + 16, kPanel * 4);
    _tile_dpbf16ps(1, 3, 5);
    _tile_loadd(6, b + 32, kPanel * 4);
    _tile_dpbf16ps(2, 3, 6);
  }
  _tile_stored(0, sums, kPanel * 4);
  _tile_stored(1, sums + 16, kPanel * 4);
  _tile_stored(2, sums + 32, kPanel * 4);
  asm volatile("" : : : "memory");  // the stores above are memory writes (see AmxTiles)
}

#endif

}  // namespace

void amx_bf16_panel(const uint16_t* a, int64_t rows, int64_t K, const uint32_t* panel,
                    c10::BFloat16* c, int64_t ldc, int64_t ncols, const char* ahead,
                    int64_t ahead_lines) {
#ifdef QKILN_AMX_BF16
  Ahead fetch{ahead, ahead_lines, (rows + kTileRows - 1) / kTileRows * (K / 32)};
  thread_local std::vector<uint16_t> padded;  // a short row block, zero-padded to 16 rows
  alignas(64) float sums[kTileRows * kPanel];
  for (int64_t m = 0; m < rows; m += kTileRows) {
    const int64_t valid = std::min<int64_t>(kTileRows, rows - m);
    const uint16_t* block = a + m * K;
    if (valid < kTileRows) {
      padded.assign(kTileRows * K, 0);
      std::memcpy(padded.data(), block, valid * K * sizeof(uint16_t));
      block = padded.data();
      asm volatile("" : : : "memory");
    }
    block16(block, K, panel, sums, fetch);
    store_rows(sums, valid, c + m * ldc, ldc, ncols);
  }
#else
  TORCH_CHECK(false, "bf16 GEMM: this build has no AMX path");
#endif
}

// Exact GEMMs for many rows on AMX-BF16 that read a quantized weight's integer codes instead of a
// dense bf16 copy of it: the int4 codes of the native GEMV layout (cpu_gemv_int4.cpp's header)
// and the int8 codes of the int8 layout (row-major int8 [out, K], cpu_gemv_int8.cpp).
//
// Why: without the dense copy a quantized model's CPU runtime holds its weights at 4 or 8 bits
// instead of 4 + 16 or 8 + 16 (an 8B model: ~16 GB less). And at 64 rows (an offline decode step)
// the dense AMX GEMM (cpu_gemm_bf16_amx.cpp) waited on its bf16 panels: 30 SmolLM2 layers' linears
// took 18.8 ms with the 212 MB of panels from memory and 12.3 ms with one layer's panels reused;
// int4 codes with their tables are ~0.4 of those bytes, int8 codes half.
//
// Exactness: each weight becomes the bf16 number the dense copy holds. int4: bf16((q - z) * s)
// rounded to nearest even (packed_weights._prepare_w4a16_native), looked up in a table of the 16
// values of its (channel, group), which plugins/cpu_native.py computes with that formula. int8:
// the code itself (exact in bf16; the per-channel scales are applied to the product by the
// caller, as with the dense copy of the codes). Products of bf16 are exact in fp32 and tdpbf16ps
// sums them in the same order whichever operand holds the weights, so the result is the dense AMX
// GEMM's, bit for bit (tested).
//
// Roles: the weights are the A operand (a tile row = one channel's 32 consecutive weights, one
// group, so one 16-entry table serves the row: vpermw), the activations the B operand, repacked
// once per call into B-tile order (16 K-pairs x 16 rows per tile, a 16 x 16 transpose of 32-bit
// words), and the sums come out as channels x rows, transposed on the way out.
// A task is (chunk of up to 256 rows, block of 32 channels): it dequantizes its channels' whole K
// into a scratch (2 KB a K step of 32, L1/L2), then runs passes of 32 rows: C tiles 0-3 (2
// channel blocks x 2 row blocks), A tiles 4-5, B tiles 6-7: per K step 4 tile loads, 4 tdpbf16ps.
// While it computes it fetches the next task's codes (and tables) into L2.
//
// Measured (session 18, the 2-core AMX Xeon, 30 SmolLM2 layers' int4 linears from memory, same
// process as the dense AMX GEMM): 64 rows equal (26.2 vs 26.9 ms medians; 23.2 vs 21.2 and 27.6
// vs 26.7 in other runs), 1024 rows slower (427 vs 375 ms); the int8 head at 64 rows 9.0-11.0 vs
// 8.3-9.9 ms. The tile unit's loop dominates the profile (~80% at 1024 rows; the dequantization
// ~15% at 64), so reading 4x fewer bytes did not show: hence opt-in (cpu_native.codes_amx_available).
// Tried, not kept: dequantizing each K step inside the first pass, a step ahead of its tile loads
// (no faster at 64 rows, 1.2x slower at 1080); 48-channel tasks with one 16-row block a pass (3 C
// tiles, B alternating between two tiles: 1.16x slower at 64 rows, 1.4x at 1024); each thread
// repacking all the activations itself instead of a second fork / join (1.2x slower at 1080).

#include "cpu_gemm_bf16_amx.h"
#include "qkiln_cpu.h"

#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define QKILN_CODES_AMX 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRowChunk = 256;  // rows per task
constexpr int64_t kBlock = 32;      // channels per task (two A tiles)
constexpr int64_t kChunk = 64;      // weights per row per chunk of the int4 GEMV layout
constexpr int64_t kTileRows = 4;    // output rows per tile of the int4 GEMV layout

#ifdef QKILN_CODES_AMX
// 16 rows of 16 32-bit words -> their transpose (strides in words).
inline void transpose16(const uint32_t* src, int64_t src_stride, uint32_t* dst, int64_t dst_stride) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * src_stride);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // r[4q + i] holds, in 128-bit lane L, column 4L + i of rows 4q .. 4q + 3.
  for (int q = 0; q < 4; ++q) {
    r[4 * q + 0] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
    r[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
    r[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
    r[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xDD);
    const __m512i w0 = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xDD);
    _mm512_storeu_si512(dst + (i + 0) * dst_stride, _mm512_shuffle_i32x4(v0, w0, 0x88));
    _mm512_storeu_si512(dst + (i + 8) * dst_stride, _mm512_shuffle_i32x4(v0, w0, 0xDD));
    _mm512_storeu_si512(dst + (i + 4) * dst_stride, _mm512_shuffle_i32x4(v1, w1, 0x88));
    _mm512_storeu_si512(dst + (i + 12) * dst_stride, _mm512_shuffle_i32x4(v1, w1, 0xDD));
  }
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// One K step of one channel -> its 32 bf16 weights at dst (a scratch row: the step's 32 channels
// are two A tiles of 16 rows x 64 bytes).
// int4: `chunk` is the channel's 16 words of chunk s / 2 (nibbles 0, 1 = weights 64c + j,
// 64c + 16 + j: even steps; 2, 3 the next 32: odd steps), `table` the 16 values of its group.
inline void dequantize_int4(const uint8_t* chunk, int64_t odd, const uint16_t* table, uint16_t* dst) {
  const __m512i shifts =
      _mm512_inserti64x4(_mm512_set1_epi16(8 * odd), _mm256_set1_epi16(8 * odd + 4), 1);
  const __m512i words = _mm512_broadcast_i64x4(load256(chunk));
  const __m512i idx = _mm512_and_si512(_mm512_srlv_epi16(words, shifts), _mm512_set1_epi16(0xF));
  _mm512_store_si512(dst, _mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(load256(table))));
}

// int8: 32 codes -> bf16, exact (|q| <= 128).
inline void dequantize_int8(const int8_t* codes, uint16_t* dst) {
  const auto widen = [](const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  };
  const __m512 lo = widen(codes), hi = widen(codes + 16);
  _mm512_store_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}
#endif

}  // namespace

CodesAmxGemm CodesAmxGemm::int4(const at::Tensor& packed, const at::Tensor& tables,
                                int64_t group_size, int64_t in_features, int64_t out_features) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kTileRows && packed.size(3) == 32,
              "int4 AMX GEMM: packed must be the native int4 layout uint8 [out_p / 4, in_p / 64, 4, 32]");
  const int64_t K = in_features, K_p = packed.size(1) * kChunk, G = group_size;
  TORCH_CHECK(K % 32 == 0 && G % 32 == 0 && K_p >= K && K_p - K < kChunk,
              "int4 AMX GEMM: in_features and group_size must be multiples of 32");
  TORCH_CHECK(tables.dim() == 3 && tables.scalar_type() == at::kBFloat16 && tables.is_contiguous() &&
                  tables.size(0) % kBlock == 0 && tables.size(0) >= out_features &&
                  tables.size(1) == (K + G - 1) / G && tables.size(2) == 16 &&
                  packed.size(0) * kTileRows >= out_features,
              "int4 AMX GEMM: tables must be bf16 [out rounded up to 32, num_groups, 16]");
  return CodesAmxGemm{packed.data_ptr<uint8_t>(),
                      reinterpret_cast<const uint16_t*>(tables.data_ptr<c10::BFloat16>()), 4, K,
                      K_p, G, tables.size(1), packed.size(0) * kTileRows, out_features};
}

CodesAmxGemm CodesAmxGemm::int8(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous() &&
                  weight.size(1) % 32 == 0,
              "int8 AMX GEMM: the weight must be contiguous int8 [out, in], in a multiple of 32");
  return CodesAmxGemm{reinterpret_cast<const uint8_t*>(weight.data_ptr<int8_t>()), nullptr, 8,
                      weight.size(1), weight.size(1), weight.size(1), 1, weight.size(0),
                      weight.size(0)};
}

int64_t CodesAmxGemm::num_tasks(int64_t M) const {
  return (M + kRowChunk - 1) / kRowChunk * ((N + kBlock - 1) / kBlock);
}

int64_t CodesAmxGemm::acts_size(int64_t M) const { return (M + 15) / 16 * 16 * K / 2; }

void CodesAmxGemm::prepare(const at::Tensor& x, int64_t block_begin, int64_t block_end,
                           uint32_t* acts) const {
#ifdef QKILN_CODES_AMX
  // Row block b, K step s -> acts [b][s][16 pairs][16 rows] words; rows past M are zeros.
  const int64_t M = x.size(0), steps = K / 32;
  const uint32_t* src = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
  alignas(64) uint32_t padded[16 * 16];
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t valid = std::min<int64_t>(16, M - 16 * b);
    for (int64_t s = 0; s < steps; ++s) {
      uint32_t* dst = acts + (b * steps + s) * 256;
      const uint32_t* rows = src + 16 * b * (K / 2) + 16 * s;
      if (valid == 16) {
        transpose16(rows, K / 2, dst, 16);
      } else {
        std::memset(padded, 0, sizeof(padded));
        for (int64_t r = 0; r < valid; ++r) std::memcpy(padded + 16 * r, rows + r * (K / 2), 64);
        transpose16(padded, 16, dst, 16);
      }
    }
  }
#else
  TORCH_CHECK(false, "AMX codes GEMM: this build has no AMX path");
#endif
}

void CodesAmxGemm::run(const uint32_t* acts, int64_t M, TaskStream& tasks, at::Tensor& y) const {
#ifdef QKILN_CODES_AMX
  const int64_t steps = K / 32, blocks = (N + kBlock - 1) / kBlock;
  c10::BFloat16* out = y.data_ptr<c10::BFloat16>();
  thread_local std::vector<uint16_t> scratch_store;  // [steps][32 channels][32 weights] bf16
  scratch_store.resize(steps * kBlock * 32 + 32);
  uint16_t* scratch = reinterpret_cast<uint16_t*>(
      (reinterpret_cast<uintptr_t>(scratch_store.data()) + 63) & ~uintptr_t{63});
  thread_local std::vector<int64_t> table_at_store;  // int4: step -> its group's table in a channel's
  table_at_store.resize(steps);
  for (int64_t s = 0; s < steps; ++s) table_at_store[s] = 32 * s / G * 16;  // (no division per row)
  const int64_t* table_at = table_at_store.data();
  // A block of 32 channels: its codes (int4: 8 of the layout's 4-row tiles) and tables.
  const int64_t code_bytes = bits == 4 ? kBlock * K_p / 2 : kBlock * K;
  const int64_t table_bytes = bits == 4 ? kBlock * num_groups * 32 : 0;
  auto ahead = [&](int64_t task, const char* base, int64_t bytes, int64_t steps_to_spread) {
    if (task < 0) return Ahead{nullptr, 0, steps_to_spread};
    return Ahead{base + (task % blocks) * bytes, bytes / 64, steps_to_spread};
  };
  const AmxTiles tiles;
  for (; !tasks.done(); tasks.advance()) {
    const int64_t task = tasks.task(), chunk = task / blocks, block = task % blocks;
    const int64_t r0 = chunk * kRowChunk, r1 = std::min(M, r0 + kRowChunk), c0 = block * kBlock;
    const int64_t passes = (r1 - r0 + 31) / 32;
    Ahead codes_ahead = ahead(tasks.ahead(), reinterpret_cast<const char*>(w), code_bytes, passes * steps);
    Ahead tables_ahead = ahead(tasks.ahead(), reinterpret_cast<const char*>(t), table_bytes, passes * steps);
    // K step s of the task's 32 channels -> scratch [s]; channels past out_p stay zero. (Done a step
    // ahead inside the first pass instead, to overlap the tile unit: no faster at 64 rows and 1.2x
    // slower at 1080, 30 SmolLM2 layers, same process.)
    const int64_t live = std::max<int64_t>(0, std::min(kBlock, out_p - c0));
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t c = live; c < kBlock; ++c)
        _mm512_store_si512(scratch + (s * kBlock + c) * 32, _mm512_setzero_si512());
    const uint8_t* first_code =
        bits == 4 ? w + c0 / kTileRows * (K_p / kChunk) * kTileRows * 32 : w + c0 * K;
    const uint16_t* first_table = t ? t + c0 * num_groups * 16 : nullptr;
    const int64_t tile_bytes = (K_p / kChunk) * kTileRows * 32;  // int4: 4 channels' codes
    auto dequantize_step = [=](int64_t s) {
      uint16_t* dst = scratch + s * kBlock * 32;
      if (bits == 4) {
        const uint8_t* chunk = first_code + (s / 2) * kTileRows * 32;
        const uint16_t* table = first_table + table_at[s];
        for (int64_t c = 0; c < live; ++c)
          dequantize_int4(chunk + (c / kTileRows) * tile_bytes + (c % kTileRows) * 32, s % 2,
                          table + c * num_groups * 16, dst + c * 32);
      } else {
        const int8_t* codes = reinterpret_cast<const int8_t*>(first_code) + 32 * s;
        for (int64_t c = 0; c < live; ++c) dequantize_int8(codes + c * K, dst + c * 32);
      }
    };
    for (int64_t s = 0; s < steps; ++s) dequantize_step(s);
    alignas(64) float sums[4][16 * 16];
    alignas(64) float rows_out[16 * 16];
    for (int64_t pass = 0; pass < passes; ++pass) {
      const int64_t b0 = (r0 + 32 * pass) / 16;
      const int64_t row_blocks = std::min<int64_t>(2, (r1 - r0 - 32 * pass + 15) / 16);
      const uint32_t* x0 = acts + b0 * steps * 256;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t s = 0; s < steps; ++s) {
        codes_ahead.step();
        tables_ahead.step();
        asm volatile("" : : : "memory");  // the tile loads below read the scratch (see AmxTiles)
        const uint16_t* a = scratch + s * kBlock * 32;
        _tile_loadd(4, a, 64);
        _tile_loadd(5, a + 16 * 32, 64);
        _tile_loadd(6, x0 + s * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (row_blocks == 2) {
          _tile_loadd(7, x0 + (steps + s) * 256, 64);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, sums[0], 64);
      _tile_stored(1, sums[1], 64);
      _tile_stored(2, sums[2], 64);
      _tile_stored(3, sums[3], 64);
      asm volatile("" : : : "memory");
      // sums[2 cb + rb] = channels c0 + 16 cb .., rows 16 (b0 + rb) ..: transpose, round, store.
      for (int64_t rb = 0; rb < row_blocks; ++rb)
        for (int64_t cb = 0; cb < 2; ++cb) {
          const int64_t n0 = c0 + 16 * cb, ncols = std::min<int64_t>(16, N - n0);
          if (ncols <= 0) continue;
          transpose16(reinterpret_cast<const uint32_t*>(sums[2 * cb + rb]), 16,
                      reinterpret_cast<uint32_t*>(rows_out), 16);
          const __mmask16 keep = static_cast<__mmask16>((1u << ncols) - 1);
          const int64_t m0 = 16 * (b0 + rb), valid = std::min<int64_t>(16, M - m0);
          for (int64_t r = 0; r < valid; ++r)
            _mm256_mask_storeu_epi16(out + (m0 + r) * N + n0, keep,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(rows_out + 16 * r)));
        }
    }
  }
#else
  TORCH_CHECK(false, "AMX codes GEMM: this build has no AMX path");
#endif
}

at::Tensor CodesAmxGemm::operator()(const at::Tensor& x) const {
  TORCH_CHECK(codes_amx_ready(), "AMX codes GEMM: needs AMX-BF16 (check codes_amx_ready())");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(1) == K,
              "AMX codes GEMM: x must be contiguous bf16 [M, ", K, "]");
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  // Every word is written by prepare (rows past M as zeros): no initialisation needed.
  const at::Tensor acts_store = at::empty({acts_size(M)}, x.options().dtype(at::kInt));
  uint32_t* acts = reinterpret_cast<uint32_t*>(acts_store.data_ptr<int32_t>());
  at::parallel_for(0, (M + 15) / 16, 1, [&](int64_t begin, int64_t end) { prepare(x, begin, end, acts); });
  TaskQueue queue(num_tasks(M));
  at::parallel_for(0, num_tasks(M), 1, [&](int64_t, int64_t) {
    TaskStream stream(queue);
    run(acts, M, stream, y);
  });
  return y;
}

bool codes_amx_ready() {
#ifdef QKILN_CODES_AMX
  return amx_bf16_ready();
#else
  return false;
#endif
}

at::Tensor w4a16_amx_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& tables,
                          int64_t group_size, int64_t out_features) {
  return CodesAmxGemm::int4(packed, tables, group_size, x.size(1), out_features)(x);
}

at::Tensor int8_codes_amx_gemm(const at::Tensor& x, const at::Tensor& weight) {
  return CodesAmxGemm::int8(weight)(x);
}

// Shared by the quantized GEMV kernels (cpu_gemv_int4.cpp, cpu_gemv_int8.cpp): tile geometry and
// the output store. Included by those sources only.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kRows = 4;     // output rows per tile
constexpr int64_t kChunk = 64;   // weights per row per chunk (32 bytes of nibbles)
constexpr int64_t kMaxMB = 4;    // activation rows per microkernel pass

template <typename out_t>
inline void store_row(out_t* out, int64_t index, float value) { out[index] = static_cast<out_t>(value); }

}  // namespace

// The bf16 GEMM's AMX path (cpu_gemm_bf16_amx.cpp), called by Bf16Gemm::run (cpu_gemm_bf16.cpp).
#pragma once

#include <torch/extension.h>
#include <xmmintrin.h>

// Whether this build compiled the AMX path and the process holds the tile state (asked once).
bool amx_bf16_ready();

// Tile configuration for amx_bf16_panel, loaded on construction and released on destruction, on
// the calling thread: one around each thread's share of a GEMM.
struct AmxTiles {
  AmxTiles();
  ~AmxTiles();
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
};

// Prefetches spread over a task's K steps (Bresenham): `lines` cache lines from `next` into L2 in
// `steps` calls of step(); the AMX GEMMs (bf16 panels and integer codes) fetch their next task so.
struct Ahead {
  const char* next;
  int64_t lines, steps, due = 0;
  void step() {
    for (due += lines; due >= steps; due -= steps, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

// rows x K bf16 activations `a` (row stride K, K a multiple of 32) times one 48-channel panel ->
// c [rows, ncols] bf16 (row stride ldc). Needs an AmxTiles on this thread. Meanwhile it fetches
// `ahead_lines` cache lines from `ahead` (the next panel; nullptr with 0 lines: none) into L2.
void amx_bf16_panel(const uint16_t* a, int64_t rows, int64_t K, const uint32_t* panel,
                    c10::BFloat16* c, int64_t ldc, int64_t ncols, const char* ahead,
                    int64_t ahead_lines);

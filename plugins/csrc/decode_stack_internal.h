// What the decode stack's sources share (decode_stack.cpp: the GEMV form; decode_stack_rows.cpp:
// the forms for many rows): thread shares, the step's buffers, error capture, the KV write.
#pragma once

#include <exception>
#include <utility>

#include "decode_stack.h"

namespace decode_stack_detail {

// [begin, end) of `n` items for thread `tid` of `threads`: contiguous, sizes differ by <= 1.
inline std::pair<int64_t, int64_t> share(int64_t n, int tid, int threads) {
  return {n * tid / threads, n * (tid + 1) / threads};
}

// A step's activations, shared by the threads: the residual stream (the caller's h, updated in
// place), the layer output and the fused projections' outputs, with the views the ops take.
struct StepBuffers {
  at::Tensor residual, hidden, qkv, attn, gate_up, q, k, v, qkv2d, attn2d;
  StepBuffers(const at::Tensor& h, int64_t Hq, int64_t Hkv, int64_t D, int64_t gate_up_width)
      : residual(h), hidden(at::empty_like(h)), qkv(at::empty({h.size(0), Hq + 2 * Hkv, D}, h.options())),
        attn(at::empty({h.size(0), Hq, D}, h.options())),
        gate_up(at::empty({h.size(0), gate_up_width}, h.options())), q(qkv.narrow(1, 0, Hq)),
        k(qkv.narrow(1, Hq, Hkv)), v(qkv.narrow(1, Hq + Hkv, Hkv)),
        qkv2d(qkv.view({h.size(0), (Hq + 2 * Hkv) * D})), attn2d(attn.view({h.size(0), Hq * D})) {}
};

// Nothing may throw out of a parallel region: guard() keeps the first exception, rethrow() raises
// it after the region.
struct FirstError {
  std::exception_ptr error;
  template <typename Body>
  void guard(Body&& body) {
    try {
      body();
    } catch (...) {
#pragma omp critical(qkiln_decode_stack_error)
      if (!error) error = std::current_exception();
    }
  }
  void rethrow() const {
    if (error) std::rethrow_exception(error);
  }
};

// Layer l's key and value rows into its caches at `slots`, the key offset (if any) taken off
// in fp32 first, as kv_cache.offset_key does.
void write_kv(const StackLayer& l, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots);

}  // namespace decode_stack_detail

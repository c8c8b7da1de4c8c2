// One-row fp32 linear on every thread, each on its own rows of the weight, with F.linear's own matmul (see
// split_linear.py). Plain C++ over ATen: no instruction set of its own, so it builds for any x86 CPU.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <algorithm>

namespace {

// y [rows, out] = x [rows, in] @ w[out, in]^T, rows `align`-aligned slices of w on `parts` threads. Inside the
// parallel region each slice's at::linear runs on its thread alone (torch's and MKL's nested parallelism is
// off there), so the call streams the weight from every core where one MKL GEMV streams it from one.
at::Tensor split_linear(const at::Tensor& x, const at::Tensor& w, int64_t parts, int64_t align) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [rows, in] and w [out, in]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(), "contiguous CPU tensors");
  TORCH_CHECK(parts >= 1 && align >= 1, "parts and align must be >= 1");
  const int64_t out = w.size(0);
  const int64_t step = ((out + parts - 1) / parts + align - 1) / align * align;
  at::Tensor y = at::empty({x.size(0), out}, x.options());
  at::parallel_for(0, parts, 1, [&](int64_t a, int64_t b) {
    // A worker thread has none of the caller's thread-local modes: no autograd here (the weight may have
    // requires_grad set; the caller only splits outside grad mode), and no inference tensors leak out.
    c10::InferenceMode guard;
    for (int64_t p = a; p < b; ++p) {
      const int64_t lo = p * step, hi = std::min(out, lo + step);
      if (lo < hi) y.slice(1, lo, hi).copy_(at::linear(x, w.slice(0, lo, hi)));
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(chattts_split_linear, m) {
  m.def("split_linear(Tensor x, Tensor w, int parts, int align) -> Tensor");
  m.impl("split_linear", c10::DispatchKey::CPU, &split_linear);
}

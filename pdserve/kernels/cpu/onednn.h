// fp32 products through torch's oneDNN (`mkldnn::_linear_pointwise`), shared by the layer
// kernels (int4_linear.cpp's prefill path, flat_decoder.cpp's dense linears) and mirrored in
// Python by `pdserve.kernels.onednn.linear`, which decides with the same test, so the Python
// and C++ decode loops run the same product.
//
// Why: MKL's sgemm takes its AVX2 path on AMD CPUs. On the Zen 5 EPYC, SmolLM2's shapes ran
// through F.linear at 175-205 GFLOP/s (prefill) and through oneDNN at 350-470, and 1.8-3.4x
// faster at decode sizes too (docs/perf.md). oneDNN builds a primitive the first time it
// sees a shape (~1-3 ms) and caches it. torch.backends.mkldnn.enabled = False turns it off.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string>

namespace pdserve_onednn {

inline const c10::OperatorHandle* linear_op() {
  static const std::optional<c10::OperatorHandle> op =
      at::hasMKLDNN() ? c10::Dispatcher::singleton().findOp({"mkldnn::_linear_pointwise", ""})
                      : std::nullopt;
  return op && op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ? &*op : nullptr;
}

// Whether torch has the op and oneDNN is on (torch.backends.mkldnn.enabled).
inline bool enabled() {
  return at::globalContext().userEnabledMkldnn() && linear_op() != nullptr;
}

// Whether an fp32 product x @ w^T (+ bias) on the CPU goes through oneDNN.
inline bool takes(const at::Tensor& x, const at::Tensor& w) {
  return x.device().is_cpu() && x.scalar_type() == at::kFloat &&
         w.scalar_type() == at::kFloat && w.dim() == 2 && x.numel() > 0 && enabled();
}

// x @ w^T + bias through oneDNN; callers check `takes` first. Boxed: the op's schema, not a
// C++ signature this file would have to track.
inline at::Tensor product(const at::Tensor& x, const at::Tensor& w,
                         const std::optional<at::Tensor>& bias) {
  torch::jit::Stack stack{x.contiguous(), w,
                          bias.has_value() ? c10::IValue(*bias) : c10::IValue(),
                          c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<c10::Scalar>>()), c10::IValue()};
  linear_op()->callBoxed(&stack);
  return stack.at(0).toTensor();
}

// F.linear, through oneDNN where it takes the product.
inline at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w,
                               const std::optional<at::Tensor>& bias) {
  return takes(x, w) ? product(x, w, bias) : at::linear(x, w, bias);
}

}  // namespace pdserve_onednn

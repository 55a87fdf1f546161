// The flat decode loop's decoder layers in one call from Python (engine/flat_decode.py).
//
// At batch 1 the real default model (30 narrow layers) ran ~17 torch calls a layer from
// Python, about 500 a step; the interpreter and the Python side of each call, not the work
// inside them, took a quarter of the step. FlatDecoder holds the layers' weights once and runs
// the same operators on the same arguments in the same order as the Python loop
// (`FlatDecode._python_layers`), through the dispatcher, so its hidden state is the same bits.
//
//   d = torch.classes.pdserve_layers.FlatDecoder()
//   i = d.add_linear(kind, tensors, group, bias, post_bias)  // see LinearKind
//   d.add_layer(input_norm, eps, qkv, q_size, kv_size, o, post_norm, eps, gate_up, down,
//               heads, kv_heads, head_dim, scale, window)
//   x = d.forward(x, cos, sin, caches, slot_mapping, block_tables, seq_lens, query_start, rows)

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "onednn.h"

namespace {

// What a linear's forward is (pdserve.engine.layers.native.NativeKind): F.linear(x, w, bias)
// (through oneDNN where `pdserve.kernels.onednn.linear` takes it: onednn.h);
// the int4 kernel; its batch-invariant row-wise form. post_bias, where given, is added after.
enum class LinearKind : int64_t { kDense = 0, kInt4 = 1, kInt4Rowwise = 2 };

struct Linear {
  LinearKind kind;
  std::vector<at::Tensor> tensors;  // dense: {weight}; int4: {packed, scale, offset}
  int64_t group;
  c10::optional<at::Tensor> bias;
  c10::optional<at::Tensor> post_bias;
};

struct Layer {
  at::Tensor input_norm;
  double input_eps;
  int64_t qkv, o, gate_up, down;  // indices into FlatDecoder::linears_
  std::vector<int64_t> qkv_sizes;
  at::Tensor post_norm;
  double post_eps;
  int64_t heads, kv_heads, head_dim;
  double scale;
  int64_t window;
};

using Tensor = at::Tensor;
using Int4Fn = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t);
using NormFn = Tensor(const Tensor&, const Tensor&, double);
using AddNormFn = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double);
using RotaryFn = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                            const Tensor&);
using SiluMulFn = Tensor(const Tensor&);
using WriteKvFn = void(Tensor, const Tensor&, const Tensor&, const Tensor&);
using AttentionFn = void(Tensor, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         const Tensor&, const Tensor&, double, int64_t);

template <typename Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

class FlatDecoder : public torch::CustomClassHolder {
 public:
  // The attention ops live in the other library (pdserve_cpu): it must be loaded first.
  FlatDecoder()
      : int4_(op<Int4Fn>("pdserve_layers::int4_linear")),
        int4_rowwise_(op<Int4Fn>("pdserve_layers::int4_linear_rowwise")),
        rms_norm_(op<NormFn>("pdserve_layers::rms_norm")),
        add_rms_norm_(op<AddNormFn>("pdserve_layers::add_rms_norm")),
        rotary_(op<RotaryFn>("pdserve_layers::rotary")),
        silu_mul_(op<SiluMulFn>("pdserve_layers::silu_mul")),
        write_kv_(op<WriteKvFn>("pdserve_cpu::write_kv")),
        attention_(op<AttentionFn>("pdserve_cpu::paged_attention")) {}

  int64_t add_linear(int64_t kind, std::vector<Tensor> tensors, int64_t group,
                     c10::optional<Tensor> bias, c10::optional<Tensor> post_bias) {
    TORCH_CHECK(kind >= 0 && kind <= 2, "FlatDecoder: unknown linear kind ", kind);
    const auto k = static_cast<LinearKind>(kind);
    TORCH_CHECK(tensors.size() == (k == LinearKind::kDense ? 1u : 3u),
                "FlatDecoder: a dense linear takes {weight}, an int4 one {packed, scale, offset}");
    TORCH_CHECK(k == LinearKind::kDense || !bias.has_value(),
                "FlatDecoder: an int4 linear's bias is a post_bias");
    linears_.push_back(Linear{k, std::move(tensors), group, std::move(bias), std::move(post_bias)});
    return static_cast<int64_t>(linears_.size()) - 1;
  }

  void add_layer(Tensor input_norm, double input_eps, int64_t qkv, int64_t q_size,
                 int64_t kv_size, int64_t o, Tensor post_norm, double post_eps, int64_t gate_up,
                 int64_t down, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale,
                 int64_t window) {
    const int64_t n = static_cast<int64_t>(linears_.size());
    for (int64_t i : {qkv, o, gate_up, down})
      TORCH_CHECK(i >= 0 && i < n, "FlatDecoder: no linear ", i);
    TORCH_CHECK(q_size == heads * head_dim && kv_size == kv_heads * head_dim,
                "FlatDecoder: q/kv sizes do not match the heads");
    layers_.push_back(Layer{std::move(input_norm), input_eps, qkv, o, gate_up, down,
                            {q_size, kv_size, kv_size}, std::move(post_norm), post_eps, heads,
                            kv_heads, head_dim, scale, window});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  Tensor forward(Tensor x, Tensor cos, Tensor sin, std::vector<Tensor> caches,
                 Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start,
                 Tensor rows) {
    TORCH_CHECK(caches.size() == layers_.size(), "FlatDecoder: ", layers_.size(),
                " layers, ", caches.size(), " caches");
    const int64_t t = x.size(0), n = static_cast<int64_t>(layers_.size());
    if (n == 0) return x;
    // Each layer's closing residual add is done by the next layer's input norm (add_rms_norm:
    // the same sum, then the same norm, so the same bits as an add and then rms_norm): one op
    // a layer fewer. v is written from its slice of the qkv output, without a copy.
    Tensor h = rms_norm_.call(x, layers_[0].input_norm, layers_[0].input_eps);
    for (int64_t i = 0; i < n; ++i) {
      const Layer& l = layers_[i];
      std::vector<Tensor> qkv = at::split_with_sizes(apply(l.qkv, h), l.qkv_sizes, -1);
      auto [q, k] = rotary_.call(qkv[0].view({t, l.heads, l.head_dim}),
                                 qkv[1].view({t, l.kv_heads, l.head_dim}), cos, sin);
      write_kv_.call(caches[i], k, qkv[2].view({t, l.kv_heads, l.head_dim}), slot_mapping);
      Tensor out = at::empty_like(q);
      attention_.call(out, q, caches[i], block_tables, seq_lens, query_start, rows, l.scale,
                      l.window);
      auto [s, hn] = add_rms_norm_.call(x, apply(l.o, out.view({t, l.heads * l.head_dim})),
                                        l.post_norm, l.post_eps);
      Tensor mlp = apply(l.down, silu_mul_.call(apply(l.gate_up, hn)));
      if (i + 1 == n) {
        x = at::add(s, mlp);
      } else {
        const Layer& next = layers_[i + 1];
        std::tie(x, h) = add_rms_norm_.call(s, mlp, next.input_norm, next.input_eps);
      }
    }
    return x;
  }

 private:
  Tensor apply(int64_t index, const Tensor& x) const {
    const Linear& m = linears_[index];
    Tensor y;
    switch (m.kind) {
      case LinearKind::kDense:
        y = pdserve_onednn::dense_linear(x, m.tensors[0], m.bias);
        break;
      case LinearKind::kInt4:
        y = int4_.call(x, m.tensors[0], m.tensors[1], m.tensors[2], m.group);
        break;
      case LinearKind::kInt4Rowwise:
        y = int4_rowwise_.call(x, m.tensors[0], m.tensors[1], m.tensors[2], m.group);
        break;
    }
    return m.post_bias.has_value() ? at::add(y, *m.post_bias) : y;
  }

  c10::TypedOperatorHandle<Int4Fn> int4_, int4_rowwise_;
  c10::TypedOperatorHandle<NormFn> rms_norm_;
  c10::TypedOperatorHandle<AddNormFn> add_rms_norm_;
  c10::TypedOperatorHandle<RotaryFn> rotary_;
  c10::TypedOperatorHandle<SiluMulFn> silu_mul_;
  c10::TypedOperatorHandle<WriteKvFn> write_kv_;
  c10::TypedOperatorHandle<AttentionFn> attention_;
  std::vector<Linear> linears_;
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_layers, m) {
  m.class_<FlatDecoder>("FlatDecoder")
      .def(torch::init<>())
      .def("add_linear", &FlatDecoder::add_linear)
      .def("add_layer", &FlatDecoder::add_layer)
      .def("num_layers", &FlatDecoder::num_layers)
      .def("forward", &FlatDecoder::forward);
}

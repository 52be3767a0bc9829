// oneDNN prepacked linear for inference: thin C shims over the `mkldnn::` operators that
// libtorch registers (the ones torch.compile's CPU freezing uses). Called through the
// dispatcher in boxed form, so no operator headers are needed. Errors are returned as
// messages, never thrown across the FFI boundary.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <cstring>

#include "shim.h"

namespace {
c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}
}  // namespace

namespace yatt {

void set_err(char* err, size_t len, const char* msg) {
  if (err && len > 0) {
    std::strncpy(err, msg, len - 1);
    err[len - 1] = 0;
  }
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor* b) {
  static const c10::OperatorHandle h = op("mkldnn::_linear_pointwise");
  torch::jit::Stack s;
  s.reserve(6);
  s.emplace_back(x);
  s.emplace_back(packed);
  if (b) {
    s.emplace_back(*b);
  } else {
    s.emplace_back(c10::IValue());
  }
  s.emplace_back(std::string("none"));
  s.emplace_back(c10::List<std::optional<at::Scalar>>());
  s.emplace_back(c10::IValue());
  h.callBoxed(&s);
  return s.back().toTensor();
}

}  // namespace yatt

using yatt::set_err;

extern "C" {

// Reorders a dense [out, in] f32 weight into oneDNN's blocked layout for batch `batch`.
void* yatt_onednn_pack(void* weight, int64_t batch, char* err, size_t errlen) {
  try {
    static const c10::OperatorHandle h = op("mkldnn::_reorder_linear_weight");
    torch::jit::Stack s;
    s.emplace_back(*static_cast<at::Tensor*>(weight));
    if (batch > 0) {
      s.emplace_back(batch);
    } else {
      s.emplace_back(c10::IValue());
    }
    h.callBoxed(&s);
    return new at::Tensor(s.back().toTensor());
  } catch (const std::exception& e) {
    set_err(err, errlen, e.what());
    return nullptr;
  }
}

// y = x @ W^T (+ bias) with a packed weight; x is [M, in].
void* yatt_onednn_linear(void* x, void* packed, void* bias, char* err, size_t errlen) {
  try {
    return new at::Tensor(yatt::packed_linear(*static_cast<at::Tensor*>(x),
                                              *static_cast<at::Tensor*>(packed),
                                              static_cast<at::Tensor*>(bias)));
  } catch (const std::exception& e) {
    set_err(err, errlen, e.what());
    return nullptr;
  }
}
}

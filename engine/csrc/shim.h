// What the shim's two files share: the prepacked oneDNN linear (onednn_linear.cpp) and
// the error-message convention of every extern "C" entry point.
#pragma once
#include <ATen/ATen.h>

#include <cstddef>

namespace yatt {

// Copies `msg` into the caller's buffer (truncated, always NUL-terminated).
void set_err(char* err, size_t len, const char* msg);

// y = x @ W^T (+ b) for x [M, in] and a weight packed by yatt_onednn_pack.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor* b);

}  // namespace yatt

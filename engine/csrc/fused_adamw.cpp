// One AdamW step over many parameters with libtorch's fused kernel (CPU and CUDA):
// one pass over each parameter, gradient and moment instead of the dozen elementwise
// passes the step takes as separate tensor operations.
#include "shim.h"

#include <vector>

extern "C" {
// params, grads, exp_avgs, exp_avg_sqs: `n` at::Tensor* each, same shapes and device.
// `step` is the step being taken (1-based), for the bias corrections. 0 on success.
int yatt_fused_adamw(void** params, void** grads, void** exp_avgs, void** exp_avg_sqs,
                     int64_t n, double lr, double beta1, double beta2, double weight_decay,
                     double eps, double step, char* err, size_t errlen) {
  try {
    std::vector<at::Tensor> p, g, m, v, steps;
    p.reserve(n);
    g.reserve(n);
    m.reserve(n);
    v.reserve(n);
    steps.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      p.push_back(*static_cast<at::Tensor*>(params[i]));
      g.push_back(*static_cast<at::Tensor*>(grads[i]));
      m.push_back(*static_cast<at::Tensor*>(exp_avgs[i]));
      v.push_back(*static_cast<at::Tensor*>(exp_avg_sqs[i]));
      steps.push_back(at::full({}, step, p.back().options().dtype(at::kFloat)));
    }
    at::_fused_adamw_(p, g, m, v, {}, steps, lr, beta1, beta2, weight_decay, eps,
                      /*amsgrad=*/false, /*maximize=*/false);
    return 0;
  } catch (const std::exception& e) {
    yatt::set_err(err, errlen, e.what());
    return 1;
  }
}
}

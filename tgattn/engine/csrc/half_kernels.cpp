// The half library's entry: as it loads, it hands its float16 and bfloat16 kernels (forward_half.cpp,
// backward_half.cpp, backward_bfloat16.cpp) to the main library's table, which forward() and backward()
// in ops.cpp dispatch through (see ops.h).
#include "ops.h"

namespace tgattn_fused {
namespace {

const bool registered = [] {
  set_half_kernels(at::kHalf, {&forward_heads<c10::Half>, &backward_heads<c10::Half>, &backward_edge_grads<c10::Half>});
  set_half_kernels(at::kBFloat16,
                   {&forward_heads<c10::BFloat16>, &backward_heads<c10::BFloat16>, &backward_edge_grads<c10::BFloat16>});
  return true;
}();

}  // namespace
}  // namespace tgattn_fused

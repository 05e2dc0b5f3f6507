// The backward kernels for float and double inputs (float16 and bfloat16, with their query pass, take a
// unit each in the half library: backward_half.cpp, backward_bfloat16.cpp; see ops.h).
#include "backward.h"

namespace tgattn_fused {

template void backward_heads<float>(const BackwardCall&);
template void backward_edge_grads<float>(const BackwardCall&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
template void backward_heads<double>(const BackwardCall&);
template void backward_edge_grads<double>(const BackwardCall&, const at::Tensor&, const at::Tensor&, const at::Tensor&);

}  // namespace tgattn_fused

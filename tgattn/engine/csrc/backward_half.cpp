// The backward kernels for float16 inputs, a unit of the half library (built on first need; see ops.h): the largest
// (key passes with and without the query pass, for int32 and int64 indices).
#include "backward.h"

namespace tgattn_fused {

template void backward_heads<c10::Half>(const BackwardCall&);
template void backward_edge_grads<c10::Half>(const BackwardCall&, const at::Tensor&, const at::Tensor&, const at::Tensor&);

}  // namespace tgattn_fused

// The forward kernels for float and double inputs (float16 and bfloat16: forward_half.cpp, in the half
// library; see ops.h).
#include "forward.h"

namespace tgattn_fused {

template void forward_heads<float>(const ForwardCall&);
template void forward_heads<double>(const ForwardCall&);

}  // namespace tgattn_fused

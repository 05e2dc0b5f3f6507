// The forward kernels for float16 and bfloat16 inputs, in the half library (see ops.h).
#include "forward.h"

namespace tgattn_fused {

template void forward_heads<c10::Half>(const ForwardCall&);
template void forward_heads<c10::BFloat16>(const ForwardCall&);

}  // namespace tgattn_fused

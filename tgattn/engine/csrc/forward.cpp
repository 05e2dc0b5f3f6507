// The forward kernels for every input dtype (one unit: each instance is small; see ops.h).
#include "forward.h"

namespace tgattn_fused {

template void forward_heads<float>(const ForwardCall&);
template void forward_heads<double>(const ForwardCall&);
template void forward_heads<c10::Half>(const ForwardCall&);
template void forward_heads<c10::BFloat16>(const ForwardCall&);

}  // namespace tgattn_fused

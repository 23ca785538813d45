#include "kernels/paged_kv.h"

namespace kvcm::kernels {

bool CudaKernelsCompiled() { return true; }

}  // namespace kvcm::kernels

// The emulated GPU of one build, from the builder's -D flags (build.py DEVICES).
#include <cuda_runtime_api.h>

namespace hetemu {

const EmulatedDevice& emulated_device() {
  static const EmulatedDevice device{HETEMU_CC_MAJOR, HETEMU_CC_MINOR, HETEMU_SM_COUNT, HETEMU_MAX_THREADS_PER_SM,
                                     HETEMU_RESIDENT_BLOCKS};
  return device;
}

}  // namespace hetemu

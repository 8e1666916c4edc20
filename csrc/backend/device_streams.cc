#include "backend/device_streams.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

namespace hetcomm {

c10::Device commonDevice(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                         const char* op) {
  const at::Tensor* first = nullptr;
  for (const auto* list : {&inputs, &outputs}) {
    for (const at::Tensor& t : *list) {
      if (!t.defined()) continue;
      if (first == nullptr) {
        first = &t;
      } else {
        TORCH_CHECK_VALUE(t.device() == first->device(), "hetcomm ", op,
                          ": all tensors of one operation must be on the same device, got ", first->device(), " and ",
                          t.device());
      }
    }
  }
  return first == nullptr ? c10::Device(c10::kCPU) : first->device();
}

c10::Event markCurrentStream(c10::Device device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  c10::Event event(device.type());
  event.record(impl.getStream(device));
  return event;
}

void keepAliveOnStream(const std::vector<at::Tensor>& tensors, const c10::Stream& stream) {
  c10::impl::VirtualGuardImpl impl(stream.device_type());
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.has_storage() && t.device() == stream.device()) {
      impl.recordDataPtrOnStream(t.storage().data_ptr(), stream);
    }
  }
}

c10::Stream poolStream(c10::Device device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  return impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true);
}

c10::Stream currentStream(c10::Device device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  return impl.getStream(device);
}

}  // namespace hetcomm

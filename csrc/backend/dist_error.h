#pragma once
// The errors torch users expect from a process group: DistBackendError, as an exception_ptr for
// the Work objects to complete with.
#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace hetcomm {

inline std::exception_ptr distError(const std::string& message) {
  try {
    C10_THROW_ERROR(DistBackendError, message);
  } catch (...) {
    return std::current_exception();
  }
}

// Point-to-point errors arrive as CommError; torch users expect DistBackendError.
inline std::exception_ptr asDistError(std::exception_ptr e) {
  if (!e) return nullptr;
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return distError(x.what());
  } catch (...) {
    return distError("hetcomm: unknown error");
  }
}

}  // namespace hetcomm

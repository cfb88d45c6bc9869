#include "dsync/status.h"

#include "dsync/types.h"

namespace dsync {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kNotFound: return "not found";
    case StatusCode::kAlreadyExists: return "already exists";
    case StatusCode::kFailedPrecondition: return "failed precondition";
    case StatusCode::kOutOfRange: return "out of range";
    case StatusCode::kUnavailable: return "unavailable";
    case StatusCode::kDeadlineExceeded: return "deadline exceeded";
    case StatusCode::kPermissionDenied: return "permission denied";
    case StatusCode::kProtocol: return "protocol error";
    case StatusCode::kAborted: return "aborted";
    case StatusCode::kInternal: return "internal error";
    case StatusCode::kUnimplemented: return "unimplemented";
    case StatusCode::kResourceExhausted: return "resource exhausted";
    case StatusCode::kDataLoss: return "data loss";
  }
  return "unknown status";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return fmt::format("{}: {}", StatusCodeName(code_), message_);
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  return Status(code_, fmt::format("{}: {}", context, message_));
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kInt32: return "int32";
  }
  return "unknown dtype";
}

}  // namespace dsync

// Errors are values on every library path: a Status says what went wrong in words a user
// can act on, a Result<T> carries either a value or that Status.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

namespace dsync {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,   // the caller asked for something malformed
  kNotFound = 2,          // unknown tensor, peer, ...
  kAlreadyExists = 3,
  kFailedPrecondition = 4,  // valid request in the wrong state (e.g. push before pull)
  kOutOfRange = 5,
  kUnavailable = 6,       // peer unreachable, connection lost; retrying may help
  kDeadlineExceeded = 7,
  kPermissionDenied = 8,  // wrong cluster token
  kProtocol = 9,          // malformed or incompatible frame
  kAborted = 10,          // the operation was cancelled (shutdown, peer died)
  kInternal = 11,
  kUnimplemented = 12,
  kResourceExhausted = 13,  // over a quota or a cap (staging, connections)
  kDataLoss = 14,           // stored data is torn or corrupt (a checkpoint file)
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

  // Prefixes the message with where it happened ("push tensor 3: ...").
  Status WithContext(std::string_view context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

template <typename... Args>
Status Error(StatusCode code, fmt::format_string<Args...> format, Args&&... args) {
  return Status(code, fmt::format(format, std::forward<Args>(args)...));
}

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    if (status_.ok()) status_ = Status(StatusCode::kInternal, "Result built from an OK status");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace dsync

// Early return of a non-OK Status from a function returning Status or Result<T>.
#define DSYNC_RETURN_IF_ERROR(expr)                 \
  do {                                              \
    ::dsync::Status dsync_status_ = (expr);         \
    if (!dsync_status_.ok()) return dsync_status_;  \
  } while (0)

#define DSYNC_CONCAT_INNER(a, b) a##b
#define DSYNC_CONCAT(a, b) DSYNC_CONCAT_INNER(a, b)
#define DSYNC_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()
// `DSYNC_ASSIGN_OR_RETURN(auto x, MakeX());`
#define DSYNC_ASSIGN_OR_RETURN(lhs, expr) \
  DSYNC_ASSIGN_OR_RETURN_IMPL(DSYNC_CONCAT(dsync_result_, __LINE__), lhs, expr)

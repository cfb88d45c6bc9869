#include "runtime/exec_image.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

extern char** environ;

namespace dsync::runtime {

ExecImage::ExecImage(std::string path, const std::vector<std::string>& args,
                     const std::map<std::string, std::string>& env)
    : path_(std::move(path)) {
  storage_.push_back(path_);
  storage_.insert(storage_.end(), args.begin(), args.end());
  const size_t argc = storage_.size();
  for (char** e = environ; e && *e; ++e) {
    const char* eq = std::strchr(*e, '=');
    const std::string key = eq ? std::string(*e, static_cast<size_t>(eq - *e)) : std::string(*e);
    if (!env.contains(key)) storage_.emplace_back(*e);
  }
  for (const auto& [k, v] : env) storage_.push_back(k + "=" + v);
  // Pointers taken only once storage_ has stopped growing.
  for (size_t i = 0; i < storage_.size(); ++i) {
    (i < argc ? argv_ : envp_).push_back(storage_[i].data());
  }
  argv_.push_back(nullptr);
  envp_.push_back(nullptr);
  failure_ = "cannot run " + path_ + ": exec failed (errno ";
}

void ExecImage::ExecOrExit() const noexcept {
  execve(path_.c_str(), argv_.data(), envp_.data());
  // strerror and printf are not async-signal-safe: the number, by hand.
  char digits[16];
  int n = errno, len = 0;
  do {
    digits[sizeof(digits) - 1 - len++] = static_cast<char>('0' + n % 10);
    n /= 10;
  } while (n > 0 && len < 15);
  (void)!write(STDERR_FILENO, failure_.data(), failure_.size());
  (void)!write(STDERR_FILENO, digits + sizeof(digits) - len, static_cast<size_t>(len));
  (void)!write(STDERR_FILENO, ")\n", 2);
  _exit(127);
}

}  // namespace dsync::runtime

// The argument and environment arrays of a program to run in a forked child, built before
// the fork. After fork() in a multi-threaded process the child may only make
// async-signal-safe calls until it execs (POSIX, fork(2)); setenv() and malloc() are not: a
// child forked while another thread held the allocator's lock waits for it forever (seen
// under AddressSanitizer with a launcher whose I/O threads were allocating).
#pragma once

#include <map>
#include <string>
#include <vector>

namespace dsync::runtime {

class ExecImage {
 public:
  // `path` is run with `args` after argv[0] (= path), in this process's environment with
  // `env` set on top (a key already there takes the new value).
  ExecImage(std::string path, const std::vector<std::string>& args,
            const std::map<std::string, std::string>& env);
  ExecImage(const ExecImage&) = delete;
  ExecImage& operator=(const ExecImage&) = delete;

  // In the child: execve, or on failure "cannot run PATH: exec failed (errno N)" on stderr
  // and _exit(127). Only async-signal-safe calls.
  [[noreturn]] void ExecOrExit() const noexcept;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<std::string> storage_;  // argv then environment, as "K=V"
  std::vector<char*> argv_, envp_;
  std::string failure_;  // the message's fixed part
};

}  // namespace dsync::runtime

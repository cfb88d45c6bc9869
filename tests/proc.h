// A child process of a test: its output goes to a file, it dies with the test process
// (PR_SET_PDEATHSIG), and every wait on it is bounded.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/exec_image.h"

namespace dsync::testing {

// A child process with its output in a file.
class Proc {
 public:
  Proc(const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
       const std::filesystem::path& log)
      : log_(log) {
    // Everything the child needs is made before fork (see runtime/exec_image.h).
    const runtime::ExecImage image(args.at(0), {args.begin() + 1, args.end()}, env);
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (fd >= 0) {
        dup2(fd, STDOUT_FILENO);  // the copies do not close on exec
        dup2(fd, STDERR_FILENO);
      }
      // Nothing else of the test runner's: what a program under test holds is its own.
      close_range(3, ~0U, 0);
      image.ExecOrExit();
    }
    if (fd >= 0) close(fd);
  }
  ~Proc() {
    if (pid_ > 0 && !done_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  // Waits for the exit; returns the wait status, or -1 after killing it on timeout.
  int Wait(std::chrono::seconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        done_ = true;
        return status;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    done_ = true;
    return -1;
  }
  // Waits until the output holds `text`; false on timeout or when the process has ended.
  bool WaitForOutput(const std::string& text, std::chrono::seconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      if (Output().find(text) != std::string::npos) return true;
      siginfo_t info{};  // ended? (WNOWAIT: still there for Wait)
      if (waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
          info.si_pid == pid_) {
        return Output().find(text) != std::string::npos;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }
  void Signal(int sig) { kill(pid_, sig); }

  std::string Output() const {
    std::ifstream in(log_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  pid_t pid_ = -1;
  bool done_ = false;
  std::filesystem::path log_;
};

// A fresh folder for the running test's files: /tmp/PREFIX-PID-TESTNAME. Kept after a
// failure (its logs), removed otherwise by the fixture.
inline std::filesystem::path FreshTestDir(const std::string& prefix) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    (prefix + "-" + std::to_string(getpid()) + "-" + info->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace dsync::testing

#include "ps/launcher_pipe.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>

namespace dsync::ps {

void TellLauncher(std::string_view line) {
  static std::atomic<bool> told{false};
  const char* text = std::getenv("DSYNC_READY_FD");
  if (!text || told.exchange(true)) return;
  char* end = nullptr;
  const long fd = std::strtol(text, &end, 10);
  struct stat st {};
  if (end == text || *end != '\0' || fd < 0 || fd > 1 << 20 ||
      fstat(static_cast<int>(fd), &st) != 0 || !S_ISFIFO(st.st_mode)) {
    return;
  }
  std::string out(line);
  out += '\n';
  (void)!write(static_cast<int>(fd), out.data(), out.size());
  close(static_cast<int>(fd));
}

}  // namespace dsync::ps

#include "kv_store.h"

#include <cstdio>

namespace alpsck {

Status KvTimeout(const std::vector<std::string>& keys, double timeout_s) {
  std::string which;
  for (const std::string& k : keys) {
    if (which.size() > 200) {
      which += ", ...";
      break;
    }
    which += (which.empty() ? "" : ", ") + k;
  }
  char secs[32];
  std::snprintf(secs, sizeof secs, "%g", timeout_s);
  return Status::Error(Code::kNotFound, "timed out after " + std::string(secs) + " s waiting for key(s) " + which);
}

}  // namespace alpsck

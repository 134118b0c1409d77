// alpsck._core: the nanobind binding of the C++ core, one file a concept (binding.h lists them);
// this one only makes the module.
#include "binding.h"

NB_MODULE(_core, m) {
  using namespace alpsck::binding;
  m.doc() = "alpsck's C++ checkpoint core (persistent concurrent checkpointing).";
  BindPlatform(m);
  BindOptions(m);
  BindRunDir(m);
  BindRecovery(m);
  BindCommit(m);
  BindEngine(m);
}

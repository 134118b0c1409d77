// The binding's text and error conversions (binding.h).
#include "binding.h"

#include "options.h"

namespace alpsck::binding {

nb::str Text(const std::string& s) {
  return nb::steal<nb::str>(PyUnicode_DecodeFSDefaultAndSize(s.data(), static_cast<Py_ssize_t>(s.size())));
}

[[noreturn]] void RaiseStatus(const Status& s, bool writing) {
  const char* name = "CheckpointError";
  switch (s.code()) {
    case Code::kNoSpace: name = "DiskFullError"; break;
    case Code::kIoError: name = writing ? "CheckpointWriteError" : "CheckpointIOError"; break;
    case Code::kNotFound: name = writing ? "CheckpointWriteError" : "CheckpointIOError"; break;
    case Code::kCorrupt: name = "CorruptCheckpointError"; break;
    case Code::kInvalidArgument: name = "UsageError"; break;
    case Code::kBusy: name = "RunDirLockedError"; break;
    case Code::kAborted:
    case Code::kOk: name = "CheckpointError"; break;
  }
  nb::object cls = nb::module_::import_("alpsck.errors").attr(name);
  // OSError subclasses get (errno, message): .errno is set and str() reads "[Errno N] message"
  // where the message names the file and the operation.
  const bool os_error = PyObject_IsSubclass(cls.ptr(), PyExc_OSError) == 1;
  nb::object exc = (s.err() && os_error) ? cls(s.err(), Text(s.message())) : cls(Text(s.message()));
  PyErr_SetObject(cls.ptr(), exc.ptr());
  throw nb::python_error();
}

uint32_t ReadThreads() { return static_cast<uint32_t>(EngineOptionSpec("read_threads").default_value); }

}  // namespace alpsck::binding

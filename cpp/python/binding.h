// Shared by the binding's files (cpp/python/*.cc): the nanobind type casters every file must see
// alike (the STL ones and FsPath), the text and error conversions (binding.cc), and each file's
// Bind* function, which module.cc's NB_MODULE calls.
//
// The binding only converts types and errors. Every core Status that is not OK becomes an
// alpsck.errors exception in RaiseStatus (the one place that mapping lives). Long calls (the
// snapshot copy, waits, reads, scans) release the GIL.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "engine_options.h"
#include "status.h"

namespace nb = nanobind;

// A file system path: the bytes the kernel sees. From Python it accepts str, bytes and
// os.PathLike, a str encoded as os.fsencode does (so a name that is not valid UTF-8, which Python
// holds with surrogate escapes, round-trips); to Python it is a str decoded as os.fsdecode does.
struct FsPath {
  std::string bytes;
  operator const std::string&() const { return bytes; }
};

namespace nanobind::detail {
template <>
struct type_caster<FsPath> {
  NB_TYPE_CASTER(FsPath, io_name("str | os.PathLike[str]", "str"))
  bool from_python(handle src, uint8_t, cleanup_list*) noexcept {
    PyObject* fs = PyOS_FSPath(src.ptr());
    if (!fs) {
      PyErr_Clear();
      return false;
    }
    PyObject* b = PyUnicode_Check(fs) ? PyUnicode_EncodeFSDefault(fs) : PyBytes_Check(fs) ? (Py_INCREF(fs), fs) : nullptr;
    Py_DECREF(fs);
    if (!b) {
      PyErr_Clear();
      return false;
    }
    value.bytes.assign(PyBytes_AS_STRING(b), static_cast<size_t>(PyBytes_GET_SIZE(b)));
    Py_DECREF(b);
    return value.bytes.find('\0') == std::string::npos;  // a NUL would cut the path short in C
  }
  static handle from_cpp(const FsPath& p, rv_policy, cleanup_list*) noexcept {
    return PyUnicode_DecodeFSDefaultAndSize(p.bytes.data(), static_cast<Py_ssize_t>(p.bytes.size()));
  }
};
}  // namespace nanobind::detail

namespace alpsck::binding {

using Bytes = nb::ndarray<nb::pytorch, nb::ro, nb::c_contig, nb::device::cpu>;
using MutBytes = nb::ndarray<nb::pytorch, nb::c_contig, nb::device::cpu>;

// Text from the core for Python: paths in it are bytes, maybe not UTF-8 (decoded as os.fsdecode
// does, so nothing fails and the name reads back as Python spells it).
nb::str Text(const std::string& s);

// Raise s (not OK) as its alpsck.errors exception. writing: kIoError/kNoSpace/kNotFound during a
// save are write errors; elsewhere plain I/O errors.
[[noreturn]] void RaiseStatus(const Status& s, bool writing);

// EngineOptions from a mapping of option names to values, each set through the core's option
// table (options.h): an unknown name, a value of the wrong type or out of range raises UsageError
// naming it (bind_options.cc).
EngineOptions EngineOptionsFrom(const nb::dict& options);

// The default of the readers' read_threads option (options.h).
uint32_t ReadThreads();

void BindPlatform(nb::module_& m);  // bind_platform.cc: CRC32C, build info, NUMA, file systems
void BindOptions(nb::module_& m);   // bind_options.cc: the option table
void BindEngine(nb::module_& m);    // bind_engine.cc: Engine, SaveHandle, ExternalFill
void BindRunDir(nb::module_& m);    // bind_run_dir.cc: names, the lock, pins, retention, removal
void BindRecovery(nb::module_& m);  // bind_recovery.cc: scan, pick, ShardReader
void BindCommit(nb::module_& m);    // bind_commit.cc: the DCP backend's commit and retention

}  // namespace alpsck::binding

// A torch.distributed Store as the core's KvStore (the Engine's and commit_step's `store`).
#pragma once

#include <cctype>
#include <memory>
#include <string>
#include <vector>

#include "binding.h"
#include "kv_store.h"

namespace alpsck::binding {

// A client of a torch.distributed (c10d) Store as the core's KvStore (kv_store.h, whose semantics
// are c10d's): each call takes the GIL and calls the store's method; c10d's bindings release the
// GIL while they wait on the network, so a rank blocked in wait() holds up no Python thread. A
// c10d timeout (DistStoreError saying "timeout") is KvTimeout; any other exception is the store
// failing (kIoError, with its text). The engine's threads call it; while the interpreter exits,
// every call fails and the object is leaked rather than released without the GIL.
class PyKvStore : public KvStore {
 public:
  explicit PyKvStore(nb::object store) : store_(std::move(store)) {}
  ~PyKvStore() override {
    if (Exiting()) {
      (void)store_.release();
      return;
    }
    nb::gil_scoped_acquire g;
    store_.reset();
  }
  Status Set(const std::string& key, const std::string& value) override {
    return Call("set", {key}, 0, [&] { store_.attr("set")(key, nb::bytes(value.data(), value.size())); });
  }
  Status Get(const std::string& key, double timeout_s, std::string* value) override {
    return Call("get", {key}, timeout_s, [&] {
      if (timeout_s <= 0) {
        if (!nb::cast<bool>(store_.attr("check")(std::vector<std::string>{key}))) throw Missing();
      } else {
        store_.attr("wait")(std::vector<std::string>{key}, Seconds(timeout_s));
      }
      nb::bytes b = nb::cast<nb::bytes>(store_.attr("get")(key));
      value->assign(b.c_str(), b.size());
    });
  }
  Status Add(const std::string& key, int64_t delta, int64_t* new_value) override {
    return Call("add", {key}, 0, [&] { *new_value = nb::cast<int64_t>(store_.attr("add")(key, delta)); });
  }
  Status Append(const std::string& key, const std::string& value) override {
    return Call("append", {key}, 0, [&] { store_.attr("append")(key, nb::bytes(value.data(), value.size())); });
  }
  Status CompareSet(const std::string& key, const std::string& expected, const std::string& desired,
                    std::string* current) override {
    return Call("compare_set", {key}, 0, [&] {
      nb::bytes b = nb::cast<nb::bytes>(store_.attr("compare_set")(key, expected, desired));
      current->assign(b.c_str(), b.size());
    });
  }
  Status Wait(const std::vector<std::string>& keys, double timeout_s) override {
    return Call("wait", keys, timeout_s, [&] { store_.attr("wait")(keys, Seconds(timeout_s)); });
  }
  Status DeleteKey(const std::string& key) override {
    return Call("delete_key", {key}, 0, [&] { store_.attr("delete_key")(key); });
  }
  Status Clone(std::unique_ptr<KvStore>* out) override {
    return Call("clone", {}, 0, [&] { *out = std::make_unique<PyKvStore>(store_.attr("clone")()); });
  }

 private:
  struct Missing {};  // Get with no waiting found no key
  static bool Exiting() {
#if PY_VERSION_HEX >= 0x030D0000
    return !Py_IsInitialized() || Py_IsFinalizing();
#else
    return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
  }
  static nb::object Seconds(double s) {
    return nb::module_::import_("datetime").attr("timedelta")(nb::arg("seconds") = s);
  }
  template <class F>
  Status Call(const char* what, const std::vector<std::string>& keys, double timeout_s, F&& f) {
    if (Exiting()) return Status::Error(Code::kIoError, std::string("store ") + what + ": the interpreter is exiting");
    nb::gil_scoped_acquire g;
    try {
      f();
      return Status::Ok();
    } catch (const Missing&) {
      return KvTimeout(keys, timeout_s);
    } catch (nb::python_error& e) {
      const std::string type = nb::cast<std::string>(nb::handle(e.type()).attr("__name__"));
      std::string text = nb::cast<std::string>(nb::str(e.value()));
      std::string lower = text;
      for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      if (type == "DistStoreError" && lower.find("timeout") != std::string::npos) return KvTimeout(keys, timeout_s);
      return Status::Error(Code::kIoError, std::string("store ") + what + ": " + type + ": " + text);
    } catch (const std::exception& e) {
      return Status::Error(Code::kIoError, std::string("store ") + what + ": " + e.what());
    }
  }

  nb::object store_;
};

// _core.StoreClients(store): a c10d store's connections, shared by every engine and commit_step it is
// passed to (a PooledKvStore over the store: kv_store.h says why). Bound in bind_commit.cc.
struct StoreClients {
  std::shared_ptr<PooledKvStore> kv;
};

// The store= argument of Engine and commit_step: None, a StoreClients, or a c10d store (whose clients are
// then this call's own).
inline std::shared_ptr<KvStore> KvStoreFrom(nb::object store) {
  if (store.is_none()) return nullptr;
  if (nb::isinstance<StoreClients>(store)) return nb::cast<StoreClients&>(store).kv;
  return std::make_shared<PyKvStore>(std::move(store));
}

}  // namespace alpsck::binding

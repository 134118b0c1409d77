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

struct KvClientPool::Shared {
  std::mutex mu;
  std::shared_ptr<KvStore> base;                 // only Clone()d, under mu
  std::vector<std::unique_ptr<KvStore>> idle;    // under mu
  size_t made = 0;                               // under mu
};

namespace {

// A pooled client: forwards every call, and goes back to the pool when dropped unless a call failed.
class Lent : public KvStore {
 public:
  Lent(std::shared_ptr<KvClientPool::Shared> pool, std::unique_ptr<KvStore> client)
      : pool_(std::move(pool)), client_(std::move(client)) {}
  ~Lent() override {
    if (broken_) return;
    std::lock_guard<std::mutex> l(pool_->mu);
    pool_->idle.push_back(std::move(client_));
  }
  Status Set(const std::string& key, const std::string& value) override { return Check(client_->Set(key, value)); }
  Status Get(const std::string& key, double timeout_s, std::string* value) override {
    Status s = client_->Get(key, timeout_s, value);
    if (s.code() == Code::kNotFound && timeout_s <= 0) return s;  // only looked (c10d check): nothing in flight
    return Check(std::move(s));
  }
  Status Add(const std::string& key, int64_t delta, int64_t* new_value) override {
    return Check(client_->Add(key, delta, new_value));
  }
  Status Append(const std::string& key, const std::string& value) override {
    return Check(client_->Append(key, value));
  }
  Status CompareSet(const std::string& key, const std::string& expected, const std::string& desired,
                    std::string* current) override {
    return Check(client_->CompareSet(key, expected, desired, current));
  }
  Status Wait(const std::vector<std::string>& keys, double timeout_s) override {
    return Check(client_->Wait(keys, timeout_s));
  }
  Status DeleteKey(const std::string& key) override { return Check(client_->DeleteKey(key)); }
  Status Clone(std::unique_ptr<KvStore>* out) override { return client_->Clone(out); }

 private:
  Status Check(Status s) {
    if (!s.ok()) broken_ = true;
    return s;
  }
  std::shared_ptr<KvClientPool::Shared> pool_;
  std::unique_ptr<KvStore> client_;
  bool broken_ = false;
};

}  // namespace

KvClientPool::KvClientPool(std::shared_ptr<KvStore> base) : shared_(std::make_shared<Shared>()) {
  shared_->base = std::move(base);
}

Status KvClientPool::Acquire(std::unique_ptr<KvStore>* out) {
  std::unique_ptr<KvStore> client;
  {
    std::lock_guard<std::mutex> l(shared_->mu);
    if (!shared_->idle.empty()) {
      client = std::move(shared_->idle.back());
      shared_->idle.pop_back();
    } else {
      Status s = shared_->base->Clone(&client);
      if (!s.ok()) return s;
      ++shared_->made;
    }
  }
  *out = std::make_unique<Lent>(shared_, std::move(client));
  return Status::Ok();
}

size_t KvClientPool::clients_made() const {
  std::lock_guard<std::mutex> l(shared_->mu);
  return shared_->made;
}

#define ALPSCK_ON_A_CLIENT(call)                       \
  std::unique_ptr<KvStore> client;                     \
  ALPSCK_RETURN_IF_ERROR(pool_.Acquire(&client));      \
  return client->call

Status PooledKvStore::Set(const std::string& key, const std::string& value) { ALPSCK_ON_A_CLIENT(Set(key, value)); }
Status PooledKvStore::Get(const std::string& key, double timeout_s, std::string* value) {
  ALPSCK_ON_A_CLIENT(Get(key, timeout_s, value));
}
Status PooledKvStore::Add(const std::string& key, int64_t delta, int64_t* new_value) {
  ALPSCK_ON_A_CLIENT(Add(key, delta, new_value));
}
Status PooledKvStore::Append(const std::string& key, const std::string& value) { ALPSCK_ON_A_CLIENT(Append(key, value)); }
Status PooledKvStore::CompareSet(const std::string& key, const std::string& expected, const std::string& desired,
                                 std::string* current) {
  ALPSCK_ON_A_CLIENT(CompareSet(key, expected, desired, current));
}
Status PooledKvStore::Wait(const std::vector<std::string>& keys, double timeout_s) { ALPSCK_ON_A_CLIENT(Wait(keys, timeout_s)); }
Status PooledKvStore::DeleteKey(const std::string& key) { ALPSCK_ON_A_CLIENT(DeleteKey(key)); }

#undef ALPSCK_ON_A_CLIENT

}  // namespace alpsck

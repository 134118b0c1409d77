#include "store_agreement.h"

#include <fcntl.h>

#include <cerrno>
#include <cstdio>
#include <utility>

#include "file_io.h"
#include "json.h"
#include "run_dir.h"

namespace alpsck {

namespace {

constexpr char kCommitting[] = "committing";
constexpr char kCommittedValue[] = "committed";
constexpr char kUnsyncedPrefix[] = "committed-unsynced:";
constexpr char kSpareSeparator[] = "\nspare:";  // in a "committed" value: the spare's name follows
constexpr char kAbortedPrefix[] = "aborted:";
constexpr char kAllArrived[] = "all";
constexpr char kAbortedArrival[] = "aborted";

bool StartsWith(const std::string& s, const char* p) { return s.compare(0, std::char_traits<char>::length(p), p) == 0; }
std::string After(const std::string& s, const char* p) { return s.substr(std::char_traits<char>::length(p)); }

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

bool IsTimeout(const Status& s) { return s.code() == Code::kNotFound; }

Status StoreError(const Status& s, const std::string& what) {
  return Status::Error(s.code(), what + ": " + s.message(), s.err());
}

// The rank a record line names (DecodeShardRecord then checks the rest against it).
bool RecordRank(const std::string& line, uint32_t* rank) {
  Json j;
  uint64_t r = 0;
  if (!ParseJson(line, &j, JsonLimits{8, 64 << 10}).ok()) return false;
  const Json* jr = j.find("rank");
  if (!jr || !jr->get_u64(&r) || r > UINT32_MAX) return false;
  *rank = static_cast<uint32_t>(r);
  return true;
}

}  // namespace

StoreAgreement::StoreAgreement(Env* env, Attempt a, std::unique_ptr<KvStore> store, const std::string& ns,
                               uint32_t world_size, uint32_t arrivals, uint32_t readers, double settle_timeout_s)
    : env_(env),
      a_(std::move(a)),
      store_(std::move(store)),
      prefix_(KeyPrefix(ns, a_.step, a_.attempt)),
      world_size_(world_size),
      arrivals_(arrivals),
      readers_(readers),
      settle_timeout_s_(settle_timeout_s) {}

std::string StoreAgreement::KeyPrefix(const std::string& ns, uint64_t step, uint32_t attempt) {
  return ns + "step-" + std::to_string(step) + "/a" + std::to_string(attempt) + "/";
}

std::string StoreAgreement::AbortReason(const Status& verdict) const {
  const std::string head = "step " + std::to_string(a_.step) + " was aborted: ";
  return StartsWith(verdict.message(), head.c_str()) ? verdict.message().substr(head.size()) : verdict.message();
}

// Each rank arrives once per attempt: more means keys of another run or job under this prefix.
Status StoreAgreement::TooMany(int64_t n) const {
  return Status::Invalid("the store counts " + std::to_string(n) + " arrivals of " + std::to_string(arrivals_) +
                         " ranks under " + prefix_ + ": is its namespace shared with another run?");
}

Status StoreAgreement::Aborted(const std::string& why) const {
  return Status::Error(Code::kAborted, "step " + std::to_string(a_.step) + " was aborted: " + why);
}

Verdict StoreAgreement::Remember(Verdict v, const Status& verdict, bool won) {
  settled_ = v;
  settled_status_ = verdict;
  settled_won_ = won;
  return v;
}

// ---------------------------------------------------------------- arriving

Status StoreAgreement::Arrive(uint32_t rank, const ShardRecord& record) {
  if (rank >= world_size_) return Status::Invalid("rank " + std::to_string(rank) + " is not below the world size");
  // The record before the count: whoever sees the count complete finds every record there.
  Status s = store_->Append(Key("records"), EncodeShardRecord(rank, record));
  if (!s.ok()) return StoreError(s, "publish the record of rank " + std::to_string(rank));
  int64_t n = 0;
  s = store_->Add(Key("arrived"), 1, &n);
  if (!s.ok()) return StoreError(s, "count the arrival of rank " + std::to_string(rank));
  if (n > static_cast<int64_t>(arrivals_)) return TooMany(n);
  if (n == static_cast<int64_t>(arrivals_)) {
    s = store_->Set(Key("all-arrived"), kAllArrived);
    if (!s.ok()) return StoreError(s, "say every rank arrived");
  }
  return Status::Ok();
}

Status StoreAgreement::ReadRecords(double timeout_s, std::vector<ShardRecord>* records, std::vector<bool>* have) {
  std::string text;
  Status s = store_->Get(Key("records"), timeout_s, &text);
  if (IsTimeout(s)) return Status::Ok();  // nobody arrived
  if (!s.ok()) return StoreError(s, "read the records");
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(begin, end - begin + 1);
    begin = end + 1;
    uint32_t rank = 0;
    if (!RecordRank(line, &rank) || rank >= world_size_)
      return Status::Corrupt("a record in the store under " + Key("records") + " is malformed");
    if ((*have)[rank]) continue;  // the coordinator's own record, held at hand, wins
    ALPSCK_RETURN_IF_ERROR(DecodeShardRecord(line, rank, &(*records)[rank]));
    (*have)[rank] = true;
  }
  return Status::Ok();
}

std::string StoreAgreement::MissingRanks() {
  std::vector<ShardRecord> records(world_size_);
  std::vector<bool> have(world_size_, false);
  if (!ReadRecords(0, &records, &have).ok()) return "";
  std::string which;
  for (uint32_t r = 1; r < world_size_ && which.size() < 200; ++r)
    if (!have[r]) which += (which.empty() ? "" : ", ") + std::to_string(r);
  return which.empty() ? "" : "; no shard from rank(s) " + which;
}

Status StoreAgreement::AwaitShards(double timeout_s, const ShardRecord* own, std::vector<ShardRecord>* records) {
  records->assign(world_size_, ShardRecord());
  std::vector<bool> have(world_size_, false);
  if (own) {  // held at hand: the coordinator neither publishes nor counts it
    (*records)[0] = *own;
    have[0] = true;
  }
  if (arrivals_ == 0) return Status::Ok();
  {
    // Woken by the last arrival, or by an abort's winner: no polling.
    std::string v;
    Status s = store_->Get(Key("all-arrived"), timeout_s, &v);
    if (IsTimeout(s)) {
      ReadRecords(0, records, &have);
      std::string which;
      for (uint32_t r = 0; r < world_size_ && which.size() < 200; ++r)
        if (!have[r]) which += (which.empty() ? "" : ", ") + std::to_string(r);
      return Status::Error(Code::kAborted, "no shard from rank(s) " + which + " after " + Seconds(timeout_s) + " s");
    }
    if (!s.ok()) return StoreError(s, "wait for the shards");
    if (v != kAllArrived) {  // an abort's winner woke this rank
      std::string why;
      store_->Get(Key("verdict"), 0, &why);
      return Aborted(StartsWith(why, kAbortedPrefix) ? After(why, kAbortedPrefix) : "(no reason in the store)");
    }
  }
  ALPSCK_RETURN_IF_ERROR(ReadRecords(0, records, &have));
  for (uint32_t r = 0; r < world_size_; ++r)
    if (!have[r]) return Status::Corrupt("rank " + std::to_string(r) + " counted as arrived without its record in the store");
  // A record is trusted as it stands: its rank wrote it after its shard was sealed and durable,
  // under keys of this attempt alone (FileAgreement checks each shard's size because a record
  // file could outlive its save; a key cannot). Opening every shard here would cost rank 0 two
  // metadata calls per rank per save; a shard that does not match its record is found by every
  // reader (its footer and CRCs), and never silently restored.
  return Status::Ok();
}

// ---------------------------------------------------------------- the decision

Status StoreAgreement::Commit(const CommitRequest& req) {
  claim_tried_ = true;
  std::string cur;
  Status s = store_->CompareSet(Key("verdict"), "", kCommitting, &cur);
  if (!s.ok()) return StoreError(s, "claim the commit");  // undecided (or claimed: Abort sorts it out)
  if (cur != kCommitting) return Aborted(StartsWith(cur, kAbortedPrefix) ? After(cur, kAbortedPrefix) : cur);
  // Claimed: no other rank can decide now. The keys stay until every reader has read the verdict
  // (the last acknowledgement removes them: Ack), which costs this rank no operation.
  commit_ran_ = true;
  const Status c = CommitCheckpoint(env_, req);
  std::string final_value = kCommittedValue;
  if (!req.next_spare.empty()) final_value += kSpareSeparator + req.next_spare;
  if (!c.ok()) {
    // Did the rename happen? The abort rename answers, as FileAgreement's does: it fails once the
    // directory was renamed to step-N (committed, durability unconfirmed), and it wins if the
    // commit stopped before (or a rank that gave up on this one renamed it first: aborted).
    Status verdict;
    bool won = false;
    const Verdict v = SettleOnDisk(0, c.message(), &verdict, &won);
    if (v == Verdict::kCommitted) {
      final_value = kUnsyncedPrefix + c.message();
      unsynced_ = true;
    } else {
      final_value = kAbortedPrefix + (won ? "rank 0: " + c.message() : AbortReason(verdict));
    }
  }
  // The final verdict for the waiting ranks. A store that fails now changes nothing on disk: they
  // then settle it from there, and find what this rank did.
  store_->CompareSet(Key("final"), "", final_value, &cur);
  if (c.ok() || unsynced_) {
    Remember(Verdict::kCommitted, Status::Ok(), false);
    // A commit is acknowledged by the ranks that read it, not by the coordinator that made it
    // (Ack); where nobody else reads it, the coordinator removes the keys itself.
    if (readers_ <= 1) Forget(false);
  }
  return c;
}

Verdict StoreAgreement::RecordWon(uint32_t rank, const std::string& why, Status* verdict, bool* won) {
  // On disk as with FileAgreement: the attempt's directory to its aborted name, with the reason,
  // without the shards (a rank writing late holds an unlinked file).
  if (env_->IsOwnDir(a_.tmp_dir()) == 1 && env_->Rename(a_.tmp_dir(), a_.aborted_dir()) == 0)
    RecordAbort(env_, a_, rank, why);
  const std::string reason = "rank " + std::to_string(rank) + ": " + why;
  std::string cur;
  store_->CompareSet(Key("final"), "", kAbortedPrefix + reason, &cur);
  if (rank != 0) store_->Set(Key("all-arrived"), kAbortedArrival);  // wakes the coordinator
  *verdict = Aborted(reason);
  if (won) *won = true;
  return Remember(Verdict::kAborted, *verdict, true);
}

Verdict StoreAgreement::SettleOnDisk(uint32_t rank, const std::string& why, Status* verdict, bool* won) {
  read_disk_ = true;
  bool w = false;
  const Verdict v = alpsck::Abort(env_, a_, rank, why, verdict, &w);
  if (won) *won = w;
  if (v == Verdict::kCommitted) {
    unsynced_ = true;  // the rename is visible; whether rank 0's fsync made it durable is unknown
    return Remember(v, Status::Ok(), false);
  }
  if (w) {  // tell the ranks still on the store (the final verdict cannot be a commit now)
    std::string cur;
    store_->CompareSet(Key("final"), "", kAbortedPrefix + ("rank " + std::to_string(rank) + ": " + why), &cur);
  }
  return Remember(v, *verdict, w);
}

Verdict StoreAgreement::Abort(uint32_t rank, const std::string& why, Status* verdict, bool* won) {
  if (won) *won = false;
  if (settled_ != Verdict::kPending) {
    *verdict = settled_status_;
    if (won) *won = settled_won_;
    if (settled_ == Verdict::kCommitted) Ack(rank);
    return settled_;
  }
  const std::string mine = kAbortedPrefix + ("rank " + std::to_string(rank) + ": " + why);
  std::string cur;
  Status s = store_->CompareSet(Key("verdict"), "", mine, &cur);
  if (!s.ok()) {
    // The store failed: the disk decides, as with FileAgreement.
    const bool said = why.find(s.message()) != std::string::npos;
    const Verdict v = SettleOnDisk(rank, said ? why : why + " (the store failed: " + s.message() + ")", verdict, won);
    if (v == Verdict::kCommitted) Ack(rank);
    return v;
  }
  if (cur == mine) return RecordWon(rank, why, verdict, won);
  if (StartsWith(cur, kAbortedPrefix)) {
    *verdict = Aborted(After(cur, kAbortedPrefix));
    return Remember(Verdict::kAborted, *verdict, false);
  }
  if (cur != kCommitting) {
    *verdict = Status::Corrupt("step " + std::to_string(a_.step) + ": the store holds an unknown verdict under " +
                               Key("verdict"));
    return Verdict::kAborted;
  }
  if (claim_tried_ && !commit_ran_) {
    // This rank's own claim took effect though its reply was lost: no rename has happened, and
    // nobody else can decide now. It decides the abort (the final verdict, then the disk).
    std::string fin;
    s = store_->CompareSet(Key("final"), "", mine, &fin);
    if (s.ok() && fin == mine) return RecordWon(rank, why, verdict, won);
    if (s.ok()) {
      const Verdict v = FromFinal(fin, verdict);
      if (v != Verdict::kPending) return v;
    }
    return SettleOnDisk(rank, why, verdict, won);
  }
  // The coordinator claimed the commit: its outcome is the verdict. If it goes silent, the disk
  // decides (the commit rename against this rank's abort rename).
  std::string fin;
  s = store_->Get(Key("final"), settle_timeout_s_, &fin);
  if (s.ok()) {
    const Verdict v = FromFinal(fin, verdict);
    if (v != Verdict::kPending) {
      if (v == Verdict::kCommitted) Ack(rank);
      return v;
    }
  }
  const Verdict v = SettleOnDisk(
      rank,
      why + "; rank 0 claimed the commit and gave no verdict within " + Seconds(settle_timeout_s_) + " s" +
          (s.ok() || IsTimeout(s) ? std::string() : " (the store failed: " + s.message() + ")"),
      verdict, won);
  if (v == Verdict::kCommitted) Ack(rank);
  return v;
}

Verdict StoreAgreement::FromFinal(const std::string& value, Status* verdict) {
  if (value == kCommittedValue) return Remember(Verdict::kCommitted, Status::Ok(), false);
  const std::string named = std::string(kCommittedValue) + kSpareSeparator;
  if (StartsWith(value, named.c_str())) {
    const std::string spare = value.substr(named.size());
    // Only ever the name of a free directory: a value from the store never names another path.
    if (ParseRunDirName(spare).kind == EntryKind::kFree) spare_ = spare;
    return Remember(Verdict::kCommitted, Status::Ok(), false);
  }
  if (StartsWith(value, kUnsyncedPrefix)) {
    unsynced_ = true;
    return Remember(Verdict::kCommitted, Status::Ok(), false);
  }
  if (StartsWith(value, kAbortedPrefix)) {
    *verdict = Aborted(After(value, kAbortedPrefix));
    return Remember(Verdict::kAborted, *verdict, false);
  }
  return Verdict::kPending;
}

Verdict StoreAgreement::Peek(Status* why) {
  if (settled_ != Verdict::kPending) {
    if (settled_ == Verdict::kAborted) *why = settled_status_;
    return settled_;
  }
  // An abort is final the moment it wins; a claimed commit is not yet a verdict.
  std::string v;
  if (!store_->Get(Key("verdict"), 0, &v).ok() || !StartsWith(v, kAbortedPrefix)) return Verdict::kPending;
  *why = Aborted(After(v, kAbortedPrefix));
  return Remember(Verdict::kAborted, *why, false);
}

Status StoreAgreement::AwaitVerdict(uint32_t rank, double timeout_s) {
  std::string v;
  Status s = store_->Get(Key("final"), timeout_s, &v);
  Status verdict;
  Verdict d = Verdict::kPending;
  if (s.ok()) d = FromFinal(v, &verdict);
  if (d == Verdict::kPending) {
    // No verdict in time (or the store failed): this rank tries to abort; the commit may still win.
    const std::string why = IsTimeout(s) || s.ok()
                                ? "no commit from rank 0 within " + Seconds(timeout_s) + " s" + MissingRanks()
                                : "the store failed while it waited for the verdict: " + s.message();
    d = Abort(rank, why, &verdict);
  }
  if (d == Verdict::kAborted) return verdict;
  Ack(rank);
  // Committed. Where rank 0 did not confirm the rename durable (its fsync failed, or this rank
  // read the commit from the disk), this rank syncs RUN_DIR itself, as FileAgreement's ranks do.
  return unsynced_ || read_disk_ ? SyncDir(env_, a_.run_dir) : Status::Ok();
}

// ---------------------------------------------------------------- acknowledging

void StoreAgreement::Acknowledge(uint32_t rank) { Ack(rank); }

void StoreAgreement::Ack(uint32_t rank) {
  if (acked_) return;  // once per rank, whichever path read the verdict
  acked_ = true;
  const bool aborted = settled_ != Verdict::kCommitted;
  // The coordinator made the commit: it never acknowledges one (readers - 1 ranks do). An abort is
  // acknowledged by every reader, the coordinator included.
  if (!aborted && rank == 0) return;
  int64_t n = 0;
  if (!store_->Add(Key("acks"), 1, &n).ok()) {
    // The store failed this rank: it acknowledges an abort on the disk, as FileAgreement's ranks
    // do (what neither count completes, rank 0's next open removes).
    if (aborted) SawAbort(env_, a_, rank, readers_);
    return;
  }
  if (n < static_cast<int64_t>(aborted ? readers_ : readers_ - 1)) return;
  // Every reader has read the verdict: nobody uses this attempt's keys or directories again.
  Forget(aborted);
}

void StoreAgreement::Forget(bool aborted) {
  // Only the keys this attempt can have made: each delete is a request to the store's server.
  std::vector<const char*> keys = {"verdict", "final"};
  if (arrivals_ > 0 || aborted) keys.insert(keys.end(), {"records", "arrived", "all-arrived"});
  if (readers_ > 1 || aborted) keys.push_back("acks");
  for (const char* k : keys) store_->DeleteKey(Key(k));
  if (aborted) {
    // The aborted directory (and one a late rank re-created at the attempt's name).
    for (const std::string& d : {a_.aborted_dir(), a_.tmp_dir()})
      if (env_->IsOwnDir(d) == 1) RemoveDirFiles(env_, d);
  }
}

}  // namespace alpsck

// Recovery classifies committed / incomplete / corrupt checkpoints, never trusts what is on
// disk, and names what is wrong.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "commit.h"
#include "crc32c.h"
#include "engine.h"
#include "env_fault.h"
#include "file_io.h"
#include "json.h"
#include "recovery.h"
#include "test_util.h"
#include "testing.h"

using namespace alpsck;
using alpsck_test::SaveReq;
using alpsck_test::RandomBytes;
using alpsck_test::TempDir;

namespace {

// Writes checkpoints at the given steps (each 3 extents, ~600 KB) and returns the data.
std::vector<char> MakeRun(const std::string& dir, std::vector<uint64_t> steps) {
  EngineOptions o;
  o.run_dir = dir;
  o.chunk_bytes = 64 << 10;
  o.keep_last = 0;
  std::unique_ptr<Engine> e;
  if (!Engine::Open(o, &e).ok()) return {};
  auto a = RandomBytes(600000, 1);
  for (uint64_t s : steps) {
    std::shared_ptr<SaveHandle> h;
    if (!e->Save(SaveReq(s, {{"w", a.data(), 300000}, {"x", a.data() + 300000, 299999}, {"y", a.data(), 1}}, "{}", SaveMode::kSnapshot), &h).ok())
      return {};
    h->Wait(-1);
  }
  return a;
}

std::string Shard(const std::string& dir, uint64_t step) {
  return JoinPath(JoinPath(dir, StepDirName(step)), ShardFileName(0));
}

std::vector<CheckpointInfo> Scan(const std::string& dir, bool verify) {
  std::vector<CheckpointInfo> v;
  Status s = ScanRunDir(Env::Default(), dir, verify, 3, &v);
  if (!s.ok()) std::fprintf(stderr, "scan: %s\n", s.message().c_str());
  return v;
}

}  // namespace

TEST(classifies_good_incomplete_and_corrupt) {
  TempDir d;
  REQUIRE(!MakeRun(d.path(), {10, 20, 30, 40, 50}).empty());
  // 20: bit flip in the data (found only by verify); 30: truncated; 40: manifest removed
  // (damaged: a step-N is committed by its name); plus an abandoned .tmp directory.
  REQUIRE(alpsck_test::FlipBit(Shard(d.path(), 20), 1000));
  REQUIRE(alpsck_test::Truncate(Shard(d.path(), 30), 4096));
  REQUIRE(::unlink(JoinPath(JoinPath(d.path(), StepDirName(40)), kManifestName).c_str()) == 0);
  REQUIRE(Env::Default()->Mkdir(JoinPath(d.path(), "step-000000060.tmp")) == 0);

  auto quick = Scan(d.path(), false);
  REQUIRE(quick.size() == 6);
  CHECK(quick[0].state == CheckpointState::kCommitted);
  CHECK(quick[1].state == CheckpointState::kCommitted);  // data flip invisible without verify
  CHECK(quick[2].state == CheckpointState::kCorrupt);
  CHECK(quick[3].state == CheckpointState::kDamaged && quick[3].error.find("no MANIFEST.json") == 0);
  CHECK_EQ(std::string(CheckpointStateName(quick[3].state)), std::string("damaged"));
  CHECK(quick[4].state == CheckpointState::kCommitted);
  CHECK(quick[5].state == CheckpointState::kIncomplete && quick[5].step == 60);
  CHECK_EQ(quick[0].extents, uint64_t{3});
  CHECK(quick[0].bytes > 600000);

  auto deep = Scan(d.path(), true);
  REQUIRE(deep.size() == 6);
  CHECK(deep[1].state == CheckpointState::kCorrupt);
  CHECK(deep[1].error.find("CRC mismatch in chunk 0") != std::string::npos);
  CHECK(deep[1].error.find("w") != std::string::npos);
  CHECK(deep[0].verified && deep[4].verified);
  CHECK(deep[4].state == CheckpointState::kCommitted);
}

TEST(every_tail_corruption_is_found_by_the_quick_check) {
  TempDir d;
  REQUIRE(!MakeRun(d.path(), {1}).empty());
  const std::string p = Shard(d.path(), 1);
  const long long size = alpsck_test::FileSizeOf(p);
  // The index starts at data_padded; flip a byte in the index and in the footer.
  std::unique_ptr<ShardReader> r;
  REQUIRE(ShardReader::Open(Env::Default(), p, false, &r).ok());
  const long long index_at = static_cast<long long>(r->index().layout.data_padded);
  r.reset();
  for (long long off : {index_at + 5, size - 1, size - 40, size - 64}) {
    REQUIRE(alpsck_test::FlipBit(p, off));
    auto v = Scan(d.path(), false);
    REQUIRE(v.size() == 1);
    CHECK(v[0].state == CheckpointState::kCorrupt);
    REQUIRE(alpsck_test::FlipBit(p, off));  // flip back
    v = Scan(d.path(), false);
    CHECK(v[0].state == CheckpointState::kCommitted);
  }
}

TEST(hostile_manifests_are_rejected) {
  TempDir d;
  REQUIRE(!MakeRun(d.path(), {1}).empty());
  const std::string m = JoinPath(JoinPath(d.path(), StepDirName(1)), kManifestName);
  const char* bad[] = {
      "not json",
      "{\"format\":\"alpsck-checkpoint/1\",\"step\":2,\"files\":[]}",
      "{\"format\":\"alpsck-checkpoint/1\",\"step\":1,\"files\":[{\"name\":\"../../etc/passwd\",\"bytes\":1,\"index_crc\":1}]}",
      "{\"format\":\"alpsck-checkpoint/1\",\"step\":1,\"files\":[{\"name\":\"rank-00001.bin\",\"bytes\":1,\"index_crc\":1}]}",
      "{\"format\":\"alpsck-checkpoint/1\",\"step\":1,\"files\":[{\"name\":\"rank-00000.bin\",\"bytes\":1,\"index_crc\":1}]}",
      "{\"format\":\"alpsck-checkpoint/1\",\"step\":1,\"files\":[{\"name\":\"rank-00000.bin\",\"bytes\":-5,\"index_crc\":1}]}",
  };
  for (const char* b : bad) {
    REQUIRE(alpsck_test::WriteText(m, b));
    auto v = Scan(d.path(), false);
    REQUIRE(v.size() == 1);
    CHECK(v[0].state == CheckpointState::kCorrupt);
    CHECK(!v[0].error.empty());
  }
  std::string deep(200000, '[');
  REQUIRE(alpsck_test::WriteText(m, deep));
  auto v = Scan(d.path(), false);
  CHECK(v[0].state == CheckpointState::kCorrupt);
}

TEST(manifest_carries_its_own_crc_and_v1_manifests_still_read) {
  TempDir d;
  REQUIRE(!MakeRun(d.path(), {1}).empty());
  const std::string m = JoinPath(JoinPath(d.path(), StepDirName(1)), kManifestName);
  std::string good;
  REQUIRE(ReadSmallFile(Env::Default(), m, kMaxManifestBytes, &good).ok());
  CHECK(good.find(std::string("\"format\":\"") + kManifestFormat + "\"") != std::string::npos);
  CHECK(CheckManifestCrc(good).ok());
  auto state = [&](const std::string& text, std::string* error = nullptr) {
    CHECK(alpsck_test::WriteText(m, text));
    auto v = Scan(d.path(), false);
    CHECK(v.size() == 1);
    if (v.size() != 1) return CheckpointState::kIncomplete;
    if (error) *error = v[0].error;
    return v[0].state;
  };
  CHECK(state(good) == CheckpointState::kCommitted);
  // A field nothing else cross-checks (write_seconds): one changed digit is caught by the CRC.
  const size_t ws = good.find("\"write_seconds\":") + std::strlen("\"write_seconds\":");
  std::string edited = good;
  edited[ws] = edited[ws] == '1' ? '2' : '1';
  std::string why;
  CHECK(state(edited, &why) == CheckpointState::kCorrupt);
  CHECK(why.find("MANIFEST.json: CRC32C mismatch") != std::string::npos);
  // Sealed again after the edit, the manifest is whole.
  std::string resealed = edited;
  const size_t digits = resealed.find("\"manifest_crc32c\":\"") + std::strlen("\"manifest_crc32c\":\"");
  resealed.replace(digits, 8, "00000000");
  REQUIRE(SealManifest(&resealed).ok());
  CHECK(state(resealed) == CheckpointState::kCommitted);
  // Without its CRC member a /2 manifest is corrupt; as /1 (older builds) the same text is read.
  std::string no_crc = good;
  const size_t member = no_crc.find(",\"manifest_crc32c\":");
  no_crc.erase(member, no_crc.find('}', member) - member);
  CHECK(state(no_crc, &why) == CheckpointState::kCorrupt);
  CHECK(why.find("manifest_crc32c") != std::string::npos);
  std::string v1 = no_crc;
  v1.replace(v1.find(kManifestFormat), std::strlen(kManifestFormat), kManifestFormatV1);
  CHECK(state(v1) == CheckpointState::kCommitted);
  // Two CRC members (one of them would otherwise go unchecked), or a malformed one: corrupt.
  std::string twice = good;
  twice.insert(twice.find('{') + 1, good.substr(member + 1, good.find('}', member) - member - 1) + ",");
  CHECK(state(twice) == CheckpointState::kCorrupt);
  std::string upper = good;
  upper.replace(digits, 8, "ABCDEF01");
  CHECK(state(upper) == CheckpointState::kCorrupt);
  CHECK(state(good) == CheckpointState::kCommitted);
}

TEST(reader_reads_subsets_and_names_corrupt_extents) {
  TempDir d;
  auto a = MakeRun(d.path(), {5});
  REQUIRE(!a.empty());
  std::unique_ptr<ShardReader> r;
  REQUIRE(ShardReader::Open(Env::Default(), Shard(d.path(), 5), true, &r).ok());
  CHECK_EQ(r->index().meta, std::string("{}"));
  std::vector<char> x(299999);
  REQUIRE(r->index().layout.extents.size() == 3);
  std::vector<char*> dsts{nullptr, x.data(), nullptr};
  REQUIRE(r->Read(dsts, 4).ok());
  CHECK(std::memcmp(x.data(), a.data() + 300000, x.size()) == 0);
  uint64_t progress = 0;
  CHECK(r->Verify(2, [&](uint64_t b) {
          progress = b;
          return true;
        }).ok());
  CHECK_EQ(progress, r->index().layout.data_padded);
  r.reset();
  REQUIRE(alpsck_test::FlipBit(Shard(d.path(), 5), 400000));
  REQUIRE(ShardReader::Open(Env::Default(), Shard(d.path(), 5), true, &r).ok());
  Status s = r->Read(dsts, 4);
  CHECK(s.code() == Code::kCorrupt);
  CHECK(s.message().find("x") != std::string::npos);
}

TEST(access_errors_make_a_checkpoint_unreadable_not_corrupt) {
  // EACCES / EIO say nothing about the bytes: such a checkpoint is "unreadable" (prune keeps it,
  // restore skips it), while a directory where a shard belongs is damage: "corrupt".
  TempDir d;
  REQUIRE(!MakeRun(d.path(), {10, 20, 30, 40}).empty());
  FaultEnv env;
  FaultRule rule;
  rule.op = FaultRule::Op::kOpen;
  rule.count = UINT64_MAX;
  rule.path_contains = StepDirName(20) + "/" + ShardFileName(0);
  rule.error = EACCES;
  env.AddRule(rule);
  rule.path_contains = StepDirName(30) + "/" + kManifestName;
  rule.error = EIO;
  env.AddRule(rule);
  const std::string shard40 = Shard(d.path(), 40);
  REQUIRE(::unlink(shard40.c_str()) == 0);
  REQUIRE(::mkdir(shard40.c_str(), 0755) == 0);
  std::vector<CheckpointInfo> v;
  REQUIRE(ScanRunDir(&env, d.path(), true, 2, &v).ok());
  REQUIRE(v.size() == 4);
  CHECK(v[0].state == CheckpointState::kCommitted);
  CHECK(v[1].state == CheckpointState::kUnreadable);
  CHECK(v[1].error.find("ermission denied") != std::string::npos);
  CHECK(v[2].state == CheckpointState::kUnreadable);
  CHECK(v[2].error.find("MANIFEST.json") != std::string::npos);
  CHECK(v[3].state == CheckpointState::kCorrupt);
  CHECK_EQ(std::string(CheckpointStateName(CheckpointState::kUnreadable)), std::string("unreadable"));
}

TEST(a_fifo_in_place_of_a_manifest_or_shard_is_corrupt_not_a_hang) {
  TempDir d;
  REQUIRE(!MakeRun(d.path(), {10, 20, 30}).empty());
  const std::string manifest = JoinPath(JoinPath(d.path(), StepDirName(20)), kManifestName);
  REQUIRE(::unlink(manifest.c_str()) == 0 && ::mkfifo(manifest.c_str(), 0644) == 0);
  REQUIRE(::unlink(Shard(d.path(), 30).c_str()) == 0 && ::mkfifo(Shard(d.path(), 30).c_str(), 0644) == 0);
  auto v = Scan(d.path(), true);  // an open without O_NONBLOCK would wait for a writer forever
  REQUIRE(v.size() == 3);
  CHECK(v[0].state == CheckpointState::kCommitted);
  CHECK(v[1].state == CheckpointState::kCorrupt);
  CHECK(v[2].state == CheckpointState::kCorrupt);
}

TEST(a_progress_callback_that_says_stop_cancels_the_scan) {
  TempDir d;
  REQUIRE(!MakeRun(d.path(), {10, 20, 30}).empty());
  uint64_t calls = 0;
  std::vector<CheckpointInfo> v;
  Status s = ScanRunDir(Env::Default(), d.path(), true, 2, &v, [&](uint64_t) { return ++calls < 3; });
  CHECK(s.code() == Code::kAborted);
  CHECK(s.message().find("cancelled") != std::string::npos);
  CHECK(calls >= 3 && calls < 12);  // stopped early: three checkpoints have ~30 chunks
}

TEST(missing_run_dir_and_empty_run_dir) {
  TempDir d;
  std::vector<CheckpointInfo> v;
  Status s = ScanRunDir(Env::Default(), d.sub("nope"), false, 1, &v);
  CHECK(s.code() == Code::kNotFound);
  CHECK(s.message().find("nope") != std::string::npos);
  CHECK(ScanRunDir(Env::Default(), d.path(), false, 1, &v).ok());
  CHECK(v.empty());
}

TEST(crafted_huge_chunk_size_is_read_with_a_buffer_the_size_of_the_file) {
  // A 1 KiB file whose (CRC-valid) index claims 16 GiB chunks: the reader must not allocate, let
  // alone pre-fault, 16 GiB for it (found by cpp/fuzz/fuzz_shard; before the fix this took
  // minutes or failed with ENOMEM).
  TempDir d;
  const std::string idx =
      "{\"format\":\"alpsck-shard/1\",\"rank\":0,\"align\":512,\"chunk_bytes\":17179869184,\"data_bytes\":512,"
      "\"data_padded\":512,\"crcs\":[0],\"extents\":[{\"name\":\"w\",\"offset\":0,\"size\":512}],\"meta\":\"\"}";
  uint64_t file_bytes = 0;
  const std::string file = std::string(512, 'Z') + BuildTail(idx, 512, 512, &file_bytes);
  REQUIRE(alpsck_test::WriteText(d.sub("rank-00000.bin"), file));
  std::unique_ptr<ShardReader> r;
  REQUIRE(ShardReader::Open(Env::Default(), d.sub("rank-00000.bin"), false, &r).ok());
  const auto t0 = std::chrono::steady_clock::now();
  Status s = r->Verify(2);
  CHECK(s.code() == Code::kCorrupt && s.message().find("CRC mismatch in chunk 0") != std::string::npos);
  std::vector<char> w(512);
  s = r->Read({w.data()}, 1);
  CHECK(s.code() == Code::kCorrupt);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
}

ALPSCK_TEST_MAIN()

// ----------------------------------------------------------------------------- PickCheckpoint

namespace {

// Makes committed step `step` of `dir` a DCP checkpoint: commits dcp-metadata.json with it (the
// manifest lists it with its size and CRC, and is sealed again).
bool MakeDcp(const std::string& dir, uint64_t step) {
  const std::string cp = JoinPath(dir, StepDirName(step)), mpath = JoinPath(cp, kManifestName);
  const std::string content = "{}";
  std::string text;
  Json m;
  if (!ReadSmallFile(Env::Default(), mpath, 1 << 20, &text).ok() || !ParseJson(text, &m).ok()) return false;
  Json& extra = m.set("extra", Json::Array());
  Json& f = extra.push(Json::Object());
  f.set("name", Json::Str(kDcpMetadataName));
  f.set("bytes", Json::UInt(content.size()));
  f.set("crc", Json::UInt(Crc32c(content.data(), content.size())));
  text = m.dump() + "\n";
  return SealManifest(&text).ok() && WriteFileSynced(Env::Default(), JoinPath(cp, kDcpMetadataName), content).ok() &&
         WriteFileSynced(Env::Default(), mpath, text).ok();
}

Pick PickIn(const std::string& dir, PickOptions o = PickOptions(), Env* env = Env::Default()) {
  Pick p;
  Status s = PickCheckpoint(env, dir, o, &p);
  if (!s.ok()) std::fprintf(stderr, "pick: %s\n", s.message().c_str());
  return p;
}

std::string Reasons(const Pick& p) {
  std::string r;
  for (const Skipped& k : p.skipped) r += (r.empty() ? "" : " ") + std::to_string(k.step) + ":" + k.reason;
  return r;
}

}  // namespace

TEST(pick_takes_the_newest_committed_step_dir_and_ignores_attempts_beside_it) {
  TempDir d;
  REQUIRE(!MakeRun(d.path(), {1, 2}).empty());
  // Attempt 0's .aborted is kept while attempt 1 commits step 2: step 2 is the pick all the same.
  REQUIRE(Env::Default()->Mkdir(JoinPath(d.path(), StepDirName(2) + ".aborted")) == 0);
  REQUIRE(Env::Default()->Mkdir(JoinPath(d.path(), TmpDirName(2, 1))) == 0);
  Pick p = PickIn(d.path());
  REQUIRE(p.step.has_value());
  CHECK_EQ(*p.step, uint64_t{2});
  CHECK(p.skipped.empty());
  REQUIRE(p.candidates.size() == 2);
  CHECK(p.candidates[0].step == 2 && p.candidates[1].step == 1);
  CHECK(p.path == JoinPath(d.path(), StepDirName(2)));
  CHECK_EQ(p.scanned.size(), size_t{4});
}

TEST(pick_names_every_reason_for_a_newer_step) {
  TempDir d;
  REQUIRE(!MakeRun(d.path(), {1, 2, 3, 4, 5, 6}).empty());
  REQUIRE(MakeDcp(d.path(), 6));                                                                   // other_kind
  REQUIRE(::unlink(JoinPath(JoinPath(d.path(), StepDirName(5)), kManifestName).c_str()) == 0);   // damaged
  REQUIRE(alpsck_test::Truncate(Shard(d.path(), 4), 4096));                                        // corrupt
  REQUIRE(alpsck_test::FlipBit(Shard(d.path(), 3), 1000));                                         // data_crc
  REQUIRE(Env::Default()->Mkdir(JoinPath(d.path(), TmpDirName(8, 0))) == 0);                       // incomplete
  REQUIRE(Env::Default()->Mkdir(JoinPath(d.path(), StepDirName(7) + ".aborted")) == 0);            // aborted
  PickOptions o;
  o.kind = CheckpointKind::kAlpsck;
  Pick quick = PickIn(d.path(), o);
  CHECK_EQ(Reasons(quick), std::string("8:incomplete 7:aborted 6:other_kind 5:damaged 4:corrupt"));
  REQUIRE(quick.step.has_value());
  CHECK_EQ(*quick.step, uint64_t{3});  // the data flip is invisible to the quick rule
  CHECK(!quick.info.verified);
  o.verify_data = true;
  Pick deep = PickIn(d.path(), o);
  CHECK_EQ(Reasons(deep), std::string("8:incomplete 7:aborted 6:other_kind 5:damaged 4:corrupt 3:data_crc"));
  REQUIRE(deep.step.has_value());
  CHECK_EQ(*deep.step, uint64_t{2});
  CHECK(deep.info.verified);
  CHECK(deep.skipped.back().message.find("CRC mismatch") != std::string::npos);
  REQUIRE(deep.candidates.size() == 2);
  CHECK(!deep.candidates[1].verified);  // lazily: nothing older than the pick is verified
  // The DCP reader's view: only step 6 is its kind.
  o = PickOptions();
  o.kind = CheckpointKind::kDcp;
  Pick dcp = PickIn(d.path(), o);
  REQUIRE(dcp.step.has_value());
  CHECK_EQ(*dcp.step, uint64_t{6});
  CHECK(dcp.candidates.size() == 1);
  CHECK(KindOf(dcp.info) == CheckpointKind::kDcp);
  // Another world size: other_world; a step range: only that part is considered.
  o = PickOptions();
  o.world_size = 2;
  o.max_step = 2;
  Pick world = PickIn(d.path(), o);
  CHECK(!world.step.has_value() && Reasons(world) == "2:other_world 1:other_world");
  o = PickOptions();
  o.step = 4;
  Pick four = PickIn(d.path(), o);
  CHECK(!four.step.has_value() && Reasons(four) == "4:corrupt");
  o.step = 9;
  CHECK(PickIn(d.path(), o).skipped.empty());
  // verify_all verifies every committed one (a listing); the pick is the same as verify_data's.
  o = PickOptions();
  o.verify_all = true;
  Pick all = PickIn(d.path(), o);
  REQUIRE(all.step.has_value());
  CHECK_EQ(*all.step, uint64_t{6});  // any kind
  o.kind = CheckpointKind::kAlpsck;
  all = PickIn(d.path(), o);
  REQUIRE(all.step.has_value());
  CHECK_EQ(*all.step, uint64_t{2});
  for (const CheckpointInfo& i : all.scanned)
    if (i.state == CheckpointState::kCommitted) CHECK(i.verified);
}

TEST(pick_unreadable_and_missing_run_dir) {
  TempDir d;
  REQUIRE(!MakeRun(d.path(), {1, 2}).empty());
  FaultEnv env;
  FaultRule rule;
  rule.op = FaultRule::Op::kOpen;
  rule.count = UINT64_MAX;
  rule.path_contains = StepDirName(2) + "/" + kManifestName;
  rule.error = EIO;
  env.AddRule(rule);
  Pick p = PickIn(d.path(), PickOptions(), &env);
  REQUIRE(p.step.has_value());
  CHECK_EQ(*p.step, uint64_t{1});
  CHECK_EQ(Reasons(p), std::string("2:unreadable"));
  Pick none;
  CHECK(PickCheckpoint(Env::Default(), d.sub("nope"), PickOptions(), &none).code() == Code::kNotFound);
  CHECK_EQ(std::string(CheckpointKindName(CheckpointKind::kDcp)), std::string("dcp"));
}

TEST(metrics_parse_back_strictly) {
  auto parse = [](const char* text, Metrics* out) {
    Json j;
    return ParseJson(text, &j).ok() && ParseMetrics(j, out);
  };
  Metrics m;
  CHECK(parse("{\"loss\":2.5,\"step_time\":1,\"v\":\"nan\",\"w\":\"-inf\"}", &m));
  REQUIRE(m.size() == 4);
  CHECK(m[0].second == 2.5 && m[1].second == 1.0 && std::isnan(m[2].second) && std::isinf(m[3].second));
  for (const char* bad : {"[1,2]", "{\"a\":\"NaN\"}", "{\"a\":{\"b\":1}}", "{\"a\":true}", "{\"a\":1,\"a\":2}",
                          "{\"a b\":1}", "{\"\":1}", "{\"a\":null}"}) {
    Metrics out = {{"kept", 1.0}};
    CHECK(!parse(bad, &out));
    CHECK(out.size() == 1 && out[0].first == "kept");  // left as it was
  }
}

TEST(pick_skips_a_checkpoint_whose_metrics_are_not_finite_unless_allowed) {
  TempDir d;
  EngineOptions o;
  o.run_dir = d.path();
  o.keep_last = 0;
  std::unique_ptr<Engine> e;
  REQUIRE(Engine::Open(o, &e).ok());
  std::vector<char> a(100, 'x');
  for (const auto& [step, loss] : {std::make_pair(10, 1.0), std::make_pair(20, 0.5), std::make_pair(30, std::nan(""))}) {
    std::shared_ptr<SaveHandle> h;
    REQUIRE(e->Save(SaveReq(step, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot, CommitMode::kAuto,
                    Status::Ok(), SaveNotes{{{"loss", loss}, {"lr", 0.1}}, "", false}), &h).ok());
    REQUIRE(h->Wait(-1) && h->status().ok());
  }
  e->Close();
  Pick p;
  REQUIRE(PickCheckpoint(Env::Default(), d.path(), PickOptions{}, &p).ok());
  REQUIRE(p.step && *p.step == 20);
  REQUIRE(p.skipped.size() == 1);
  CHECK(p.skipped[0].step == 30 && p.skipped[0].reason == "unhealthy");
  CHECK(p.skipped[0].message.find("loss=nan") != std::string::npos);
  CHECK(p.candidates.size() == 2);  // 20, then 10: a fall-back never lands on an unhealthy one either
  PickOptions allow;
  allow.allow_unhealthy = true;
  REQUIRE(PickCheckpoint(Env::Default(), d.path(), allow, &p).ok());
  CHECK(p.step && *p.step == 30 && p.skipped.empty());
}

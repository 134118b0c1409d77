// Layout planning, chunk gather/scatter, footer and index encoding — and their rejection of
// hostile input.
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "crc32c.h"
#include "format.h"
#include "testing.h"

using namespace alpsck;

TEST(layout_packs_extents_and_chunks_cover_padded_data) {
  ShardLayout l;
  REQUIRE(PlanLayout({{"a", 100}, {"b", 5000}, {"c", 0}, {"d", 3}}, 4096, 8192, 64, &l).ok());
  CHECK_EQ(l.extents[0].offset, uint64_t{0});
  CHECK_EQ(l.extents[1].offset, uint64_t{128});
  CHECK_EQ(l.extents[2].offset, uint64_t{5184});
  CHECK_EQ(l.extents[3].offset, uint64_t{5184});
  CHECK_EQ(l.data_bytes, uint64_t{5187});
  CHECK_EQ(l.data_padded, uint64_t{8192});
  CHECK_EQ(l.num_chunks(), uint64_t{1});
  CHECK_EQ(l.chunk_len(0), uint64_t{8192});
}

TEST(layout_rejects_bad_input) {
  ShardLayout l;
  CHECK(!PlanLayout({{"a", 1}, {"a", 2}}, 4096, 8192, 64, &l).ok());  // duplicate
  CHECK(!PlanLayout({{"", 1}}, 4096, 8192, 64, &l).ok());              // empty name
  CHECK(!PlanLayout({{std::string("a\0b", 3), 1}}, 4096, 8192, 64, &l).ok());
  CHECK(!PlanLayout({{"a", 1}}, 3000, 6000, 64, &l).ok());             // align not a power of two
  CHECK(!PlanLayout({{"a", 1}}, 4096, 5000, 64, &l).ok());             // chunk not a multiple
  CHECK(!PlanLayout({{"a", 1ull << 62}, {"b", 1ull << 62}}, 4096, 8192, 64, &l).ok());
}

TEST(layout_is_64bit_past_4gib) {
  ShardLayout l;
  REQUIRE(PlanLayout({{"big", 5ull << 30}, {"tail", 10}}, 65536, 8ull << 20, 64, &l).ok());
  CHECK_EQ(l.extents[1].offset, 5ull << 30);
  CHECK_EQ(l.num_chunks(), (5ull << 30) / (8ull << 20) + 1);
  CHECK_EQ(l.chunk_begin(l.num_chunks() - 1), 5ull << 30);
  CHECK_EQ(l.chunk_len(l.num_chunks() - 1), uint64_t{65536});
}

TEST(gather_then_scatter_round_trips_with_zero_padding) {
  std::mt19937 rng(1);
  std::vector<std::vector<char>> bufs;
  std::vector<std::pair<std::string, uint64_t>> sizes;
  for (int i = 0; i < 40; ++i) {
    uint64_t n = rng() % 20000;
    bufs.emplace_back(n);
    for (auto& c : bufs.back()) c = static_cast<char>(rng());
    sizes.emplace_back("t" + std::to_string(i), n);
  }
  ShardLayout l;
  REQUIRE(PlanLayout(sizes, 4096, 16384, 64, &l).ok());
  std::vector<const char*> srcs;
  std::vector<std::vector<char>> outs;
  std::vector<char*> dsts;
  for (auto& b : bufs) {
    srcs.push_back(b.data());
    outs.emplace_back(b.size(), 0);
  }
  for (auto& o : outs) dsts.push_back(o.data());
  std::vector<char> image(l.data_padded, 'X');
  for (uint64_t i = 0; i < l.num_chunks(); ++i) GatherChunk(l, srcs, i, image.data() + l.chunk_begin(i));
  for (uint64_t i = 0; i < l.num_chunks(); ++i) ScatterChunk(l, dsts, i, image.data() + l.chunk_begin(i));
  for (size_t k = 0; k < bufs.size(); ++k) CHECK(bufs[k] == outs[k]);
  // Gaps and padding are zero, never stale bytes.
  for (uint64_t p = l.data_bytes; p < l.data_padded; ++p) CHECK(image[p] == 0);
  CHECK(image[l.extents[0].offset + l.extents[0].size] == 0 || l.extents[1].offset == l.extents[0].size);
}

TEST(gather_with_crc_writes_what_gather_writes_and_its_crc) {
  // Chunks of several kGatherCrcPiece pieces, extents and zero gaps straddling the pieces'
  // boundaries, empty extents, a shorter last chunk: the fused pass must equal a gather followed
  // by a CRC of the gathered bytes, for every chunk.
  std::mt19937 rng(7);
  for (uint64_t chunk : {uint64_t{4096}, kGatherCrcPiece, 2 * kGatherCrcPiece, 3 * kGatherCrcPiece + 8192}) {
    std::vector<std::vector<char>> bufs;
    std::vector<std::pair<std::string, uint64_t>> sizes;
    for (int i = 0; i < 30; ++i) {
      uint64_t n = (i % 7 == 3) ? 0 : rng() % (kGatherCrcPiece + 5000);
      bufs.emplace_back(n);
      for (auto& c : bufs.back()) c = static_cast<char>(rng());
      sizes.emplace_back("t" + std::to_string(i), n);
    }
    ShardLayout l;
    REQUIRE(PlanLayout(sizes, 4096, chunk, 8192, &l).ok());  // gaps of up to 8 KiB between extents
    REQUIRE(l.num_chunks() > 1);
    std::vector<const char*> srcs;
    for (auto& b : bufs) srcs.push_back(b.data());
    // The expected data region, built without the gather code: zeros, each extent's bytes at its offset.
    std::vector<char> image(l.data_padded, 0);
    for (size_t k = 0; k < bufs.size(); ++k)
      if (!bufs[k].empty()) std::memcpy(image.data() + l.extents[k].offset, bufs[k].data(), bufs[k].size());
    for (uint64_t i = 0; i < l.num_chunks(); ++i) {
      const std::vector<char> want(image.begin() + l.chunk_begin(i), image.begin() + l.chunk_begin(i) + l.chunk_len(i));
      std::vector<char> plain(l.chunk_len(i), 'X'), fused(l.chunk_len(i), 'Y');
      GatherChunk(l, srcs, i, plain.data());
      const uint32_t crc = GatherChunkCrc(l, srcs, i, fused.data());
      CHECK(plain == want);
      CHECK(fused == want);
      CHECK_EQ(crc, Crc32c(want.data(), want.size()));
    }
  }
}

TEST(direct_source_only_for_aligned_whole_chunks) {
  alignas(4096) static char big[4 * 4096];
  ShardLayout l;
  REQUIRE(PlanLayout({{"a", sizeof(big)}}, 4096, 4096, 64, &l).ok());
  std::vector<const char*> srcs{big};
  CHECK(DirectSource(l, srcs, 1, 4096) == big + 4096);
  std::vector<const char*> off{big + 1};
  CHECK(DirectSource(l, off, 1, 4096) == nullptr);
  ShardLayout l2;
  REQUIRE(PlanLayout({{"a", 100}}, 4096, 4096, 64, &l2).ok());
  CHECK(DirectSource(l2, srcs, 0, 1) == nullptr);  // needs padding
}

TEST(footer_round_trip_and_every_corruption_detected) {
  Footer f{8192, 300, 0xdeadbeef, 8192, 12288};
  char buf[kFooterBytes];
  EncodeFooter(f, buf);
  Footer g;
  REQUIRE(DecodeFooter(buf, 12288, "x", &g).ok());
  CHECK_EQ(g.index_crc, 0xdeadbeefu);
  CHECK(!DecodeFooter(buf, 12289, "x", &g).ok());  // size mismatch
  for (size_t i = 0; i < kFooterBytes; ++i) {
    char c[kFooterBytes];
    std::memcpy(c, buf, kFooterBytes);
    c[i] ^= 1;
    CHECK(!DecodeFooter(c, 12288, "x", &g).ok());
  }
  Footer h{8192, 1ull << 40, 0, 8192, 12288};  // index longer than the file
  EncodeFooter(h, buf);
  CHECK(!DecodeFooter(buf, 12288, "x", &g).ok());
}

TEST(index_round_trip) {
  ShardIndex idx;
  REQUIRE(PlanLayout({{"model/w", 10000}, {"weird \"name\"\n", 5}}, 4096, 8192, 64, &idx.layout).ok());
  idx.crcs = {1, 4294967295u};
  idx.meta = "{\"tree\": [1, 2]}";
  idx.rank = 3;
  std::string j = EncodeIndex(idx);
  ShardIndex back;
  REQUIRE(DecodeIndex(j, idx.layout.data_padded, &back).ok());
  CHECK_EQ(back.layout.extents[1].name, std::string("weird \"name\"\n"));
  CHECK(back.crcs == idx.crcs);
  CHECK_EQ(back.meta, idx.meta);
  CHECK_EQ(back.rank, 3u);
  CHECK(!DecodeIndex(j, idx.layout.data_padded + 4096, &back).ok());
}

TEST(index_rejects_hostile_documents) {
  const char* bad[] = {
      "[]",
      "{\"format\":\"other\"}",
      // extent past the data region
      "{\"format\":\"alpsck-shard/1\",\"rank\":0,\"align\":4096,\"chunk_bytes\":4096,\"data_bytes\":10,"
      "\"data_padded\":4096,\"crcs\":[1],\"extents\":[{\"name\":\"a\",\"offset\":0,\"size\":11}],\"meta\":\"\"}",
      // overlapping extents
      "{\"format\":\"alpsck-shard/1\",\"rank\":0,\"align\":4096,\"chunk_bytes\":4096,\"data_bytes\":10,"
      "\"data_padded\":4096,\"crcs\":[1],\"extents\":[{\"name\":\"a\",\"offset\":0,\"size\":8},"
      "{\"name\":\"b\",\"offset\":4,\"size\":2}],\"meta\":\"\"}",
      // wrong number of CRCs
      "{\"format\":\"alpsck-shard/1\",\"rank\":0,\"align\":4096,\"chunk_bytes\":4096,\"data_bytes\":10,"
      "\"data_padded\":4096,\"crcs\":[],\"extents\":[],\"meta\":\"\"}",
      // huge offset that would overflow offset+size
      "{\"format\":\"alpsck-shard/1\",\"rank\":0,\"align\":4096,\"chunk_bytes\":4096,\"data_bytes\":10,"
      "\"data_padded\":4096,\"crcs\":[1],\"extents\":[{\"name\":\"a\",\"offset\":18446744073709551615,\"size\":2}],"
      "\"meta\":\"\"}",
      // alignment not a power of two
      "{\"format\":\"alpsck-shard/1\",\"rank\":0,\"align\":3000,\"chunk_bytes\":6000,\"data_bytes\":10,"
      "\"data_padded\":3000,\"crcs\":[1],\"extents\":[],\"meta\":\"\"}",
  };
  for (const char* b : bad) {
    ShardIndex idx;
    Status s = DecodeIndex(b, 4096, &idx);
    CHECK(!s.ok());
    CHECK(s.code() == Code::kCorrupt);
  }
  std::string deep(100000, '[');
  ShardIndex idx;
  CHECK(!DecodeIndex(deep, 4096, &idx).ok());
}

ALPSCK_TEST_MAIN()

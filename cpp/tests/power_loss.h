// PowerLossModel: the states a power loss could leave, generated from a RecordingEnv log.
//
// Build() replays the log into a model of inodes: each file has its list of data changes
// (pwrite, ftruncate, fallocate, O_TRUNC), each directory its list of entry changes (create,
// mkdir, rename, unlink, rmdir), each with the fsyncs that made them durable. Generate(k, policy)
// then gives one state the disk could hold if the power failed after the first k calls:
//
//  - a file's data changes up to its last fdatasync/fsync (before k) are durable; each later
//    one may be dropped, applied, or torn: applied only in some of its 4 KiB blocks (written
//    blocks of a file reach the disk in any order, and a write is not atomic);
//  - a directory's entry changes up to its last fsync are durable; of the later ones, a prefix
//    survives (a journaling file system commits the operations on one directory in order; a
//    rename is atomic but is lost when its directory was not fsync'ed after it);
//  - the two are independent: fsync of a file does not make its name durable, fsync of a
//    directory does not make the data of the files in it durable (POSIX; stricter than ext4,
//    which often persists more).
//
// The run directory itself (the log's root) is taken to exist, empty and durable, before the
// first logged call. Renames must stay inside one directory (all of the engine's do); Build()
// reports anything it cannot model instead of guessing.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "env_record.h"

namespace alpsck_test {

class PowerLossModel {
 public:
  static constexpr uint64_t kBlock = 4096;  // unit in which a torn write reaches the disk

  struct DataOp {
    enum Kind { kWrite, kTruncate, kExtend } kind = kWrite;
    size_t at = 0;  // index in the log
    uint64_t offset = 0, length = 0;
    const std::string* data = nullptr;  // kWrite: points into the model's copy of the log
  };
  struct DirOp {
    enum Kind { kAdd, kRemove, kRename } kind = kAdd;
    size_t at = 0;
    std::string name, name2;  // kRename: name -> name2 (replacing name2 if it exists)
    int inode = -1;           // kAdd
  };
  struct Inode {
    bool dir = false;
    std::vector<DataOp> data;     // files
    std::vector<DirOp> entries;   // directories
    std::vector<size_t> syncs;    // log indexes of its fsync/fdatasync calls
  };

  enum class Fate { kDrop, kApply, kTorn };
  // Decides what a power loss did to each change that was not yet durable.
  struct Policy {
    std::string name;
    // How many entry changes of directory `inode` survive: in [synced, total].
    std::function<size_t(int inode, size_t synced, size_t total)> dir_keep;
    // What happened to an unsynced data change of file `inode`.
    std::function<Fate(int inode, const DataOp& op)> data_fate;
    // For a torn write: whether its `block`-th 4 KiB block (counted from the write's first) landed.
    std::function<bool(int inode, const DataOp& op, uint64_t block)> keep_block;
  };

  struct Entry {
    std::string path;  // relative to the root
    bool dir = false;
    std::string content;
  };
  struct State {
    std::vector<Entry> entries;  // parents before children
    uint64_t hash = 0;
    std::string Describe() const {
      std::string s;
      for (const Entry& e : entries)
        s += "  " + e.path + (e.dir ? "/" : " (" + std::to_string(e.content.size()) + " bytes)") + "\n";
      return s;
    }
  };

  bool Build(const std::string& root, std::vector<alpsck::RecordedOp> ops, std::string* error) {
    using K = alpsck::RecordedOp::Kind;
    ops_ = std::move(ops);
    root_ = root;
    inodes_.assign(1, Inode());
    inodes_[0].dir = true;
    std::vector<std::map<std::string, int>> live(1);  // per inode: entries now (directories)
    std::map<int, int> fds;                            // fd -> inode
    auto fail = [&](size_t i, const std::string& why) {
      *error = "op " + std::to_string(i) + " (" + alpsck::RecordedOpName(ops_[i].kind) + " " + ops_[i].path + "): " + why;
      return false;
    };
    // path -> (parent inode, leaf name); the root itself -> (-1, "").
    auto resolve = [&](const std::string& path, int* parent, std::string* leaf) {
      if (path == root_) {
        *parent = -1;
        return true;
      }
      if (path.compare(0, root_.size() + 1, root_ + "/") != 0) return false;
      std::string rest = path.substr(root_.size() + 1);
      int dir = 0;
      for (size_t p; (p = rest.find('/')) != std::string::npos;) {
        auto it = live[static_cast<size_t>(dir)].find(rest.substr(0, p));
        if (it == live[static_cast<size_t>(dir)].end() || !inodes_[static_cast<size_t>(it->second)].dir) return false;
        dir = it->second;
        rest = rest.substr(p + 1);
      }
      *parent = dir;
      *leaf = rest;
      return !rest.empty();
    };
    auto new_inode = [&](bool dir) {
      inodes_.emplace_back();
      inodes_.back().dir = dir;
      live.emplace_back();
      return static_cast<int>(inodes_.size() - 1);
    };
    for (size_t i = 0; i < ops_.size(); ++i) {
      const alpsck::RecordedOp& op = ops_[i];
      int parent = -1;
      std::string leaf;
      // One entry change of directory `parent`, logged at op i.
      auto add_dir_op = [&](DirOp::Kind kind, const std::string& name, int entry_inode = -1,
                            const std::string& name2 = std::string()) {
        DirOp d;
        d.kind = kind;
        d.at = i;
        d.name = name;
        d.name2 = name2;
        d.inode = entry_inode;
        inodes_[static_cast<size_t>(parent)].entries.push_back(std::move(d));
      };
      auto file_of = [&](int fd, int* inode) {
        auto it = fds.find(fd);
        if (it == fds.end()) return false;
        *inode = it->second;
        return true;
      };
      int inode = -1;
      switch (op.kind) {
        case K::kOpen: {
          if (!resolve(op.path, &parent, &leaf)) return fail(i, "path outside the modelled tree");
          if (parent < 0) {
            fds[op.fd] = 0;
            break;
          }
          auto it = live[static_cast<size_t>(parent)].find(leaf);
          const bool exists = it != live[static_cast<size_t>(parent)].end();
          if (op.created == exists) return fail(i, "log and model disagree on whether the file exists");
          if (op.created) {
            inode = new_inode(false);  // may reallocate `live`: index it again below
            live[static_cast<size_t>(parent)][leaf] = inode;
            add_dir_op(DirOp::kAdd, leaf, inode);
          } else {
            inode = it->second;
            if ((op.flags & O_TRUNC) && !inodes_[static_cast<size_t>(inode)].dir) {
              DataOp t;
              t.kind = DataOp::kTruncate;
              t.at = i;
              inodes_[static_cast<size_t>(inode)].data.push_back(t);
            }
          }
          fds[op.fd] = inode;
          break;
        }
        case K::kClose:
          fds.erase(op.fd);
          break;
        case K::kPWrite:
        case K::kFTruncate:
        case K::kFAllocate: {
          if (!file_of(op.fd, &inode) || inodes_[static_cast<size_t>(inode)].dir) return fail(i, "not an open file");
          DataOp d;
          d.at = i;
          d.kind = op.kind == K::kPWrite ? DataOp::kWrite : op.kind == K::kFTruncate ? DataOp::kTruncate : DataOp::kExtend;
          d.offset = op.offset;
          d.length = op.length;
          d.data = &op.data;
          inodes_[static_cast<size_t>(inode)].data.push_back(d);
          break;
        }
        case K::kFDataSync:
        case K::kFSync:
          if (!file_of(op.fd, &inode)) return fail(i, "sync of an fd that is not open");
          inodes_[static_cast<size_t>(inode)].syncs.push_back(i);
          break;
        case K::kMkdir: {
          if (!resolve(op.path, &parent, &leaf) || parent < 0) return fail(i, "path outside the modelled tree");
          if (live[static_cast<size_t>(parent)].count(leaf)) return fail(i, "mkdir over an existing name");
          inode = new_inode(true);
          live[static_cast<size_t>(parent)][leaf] = inode;
          add_dir_op(DirOp::kAdd, leaf, inode);
          break;
        }
        case K::kRename: {
          int p2 = -1;
          std::string leaf2;
          if (!resolve(op.path, &parent, &leaf) || !resolve(op.path2, &p2, &leaf2) || parent < 0 || p2 < 0)
            return fail(i, "path outside the modelled tree");
          if (p2 != parent) return fail(i, "rename across directories is not modelled");
          auto& dir = live[static_cast<size_t>(parent)];
          auto it = dir.find(leaf);
          if (it == dir.end()) return fail(i, "rename of a missing name");
          inode = it->second;
          dir.erase(it);
          dir[leaf2] = inode;
          add_dir_op(DirOp::kRename, leaf, -1, leaf2);
          break;
        }
        case K::kUnlink:
        case K::kRmdir: {
          if (!resolve(op.path, &parent, &leaf) || parent < 0) return fail(i, "path outside the modelled tree");
          if (!live[static_cast<size_t>(parent)].erase(leaf)) return fail(i, "removal of a missing name");
          add_dir_op(DirOp::kRemove, leaf);
          break;
        }
        case K::kMark:
          break;
      }
    }
    return true;
  }

  size_t num_ops() const { return ops_.size(); }
  const std::vector<alpsck::RecordedOp>& ops() const { return ops_; }
  const std::vector<Inode>& inodes() const { return inodes_; }

  // The largest value noted with Mark(label, v) among the first k calls; -1 if none.
  // The largest value marked `label` among the first k calls; a mark labelled `reset` (if given)
  // sets it to its own value, whatever came before.
  int64_t LastMark(size_t k, const std::string& label, const std::string& reset = "") const {
    int64_t best = -1;
    for (size_t i = 0; i < k && i < ops_.size(); ++i) {
      if (ops_[i].kind != alpsck::RecordedOp::Kind::kMark) continue;
      if (ops_[i].label == label) best = std::max<int64_t>(best, static_cast<int64_t>(ops_[i].value));
      else if (!reset.empty() && ops_[i].label == reset) best = static_cast<int64_t>(ops_[i].value);
    }
    return best;
  }

  // Number of changes (data for a file, entries for a directory) among the first k calls, and
  // how many of them an fsync had made durable by then.
  void Counts(const Inode& n, size_t k, size_t* synced, size_t* total) const {
    size_t last_sync = 0;
    for (size_t s : n.syncs)
      if (s < k) last_sync = std::max(last_sync, s);
    *synced = *total = 0;
    auto count = [&](size_t at) {
      if (at >= k) return;
      ++*total;
      if (at < last_sync) ++*synced;
    };
    if (n.dir)
      for (const DirOp& d : n.entries) count(d.at);
    else
      for (const DataOp& d : n.data) count(d.at);
  }

  // True if some inode has a change among the first k calls that is not durable yet.
  bool AnythingUnsynced(size_t k) const {
    for (const Inode& n : inodes_) {
      size_t synced, total;
      Counts(n, k, &synced, &total);
      if (synced < total) return true;
    }
    return false;
  }

  // The state a power loss after the first k calls leaves, under `policy`.
  State Generate(size_t k, const Policy& policy) const {
    State st;
    std::vector<bool> seen(inodes_.size(), false);
    Walk(k, policy, 0, "", &seen, &st);
    // A 64-bit hash of paths, kinds and contents (std::hash: compiled optimised in libstdc++,
    // which matters for the -O0 sanitizer builds).
    uint64_t h = 1469598103934665603ull;
    auto mix = [&](const std::string& s) {
      h = (h ^ std::hash<std::string_view>()(s)) * 1099511628211ull;
      h = (h ^ s.size()) * 1099511628211ull;
    };
    for (const Entry& e : st.entries) {
      mix(e.path);
      mix(e.dir ? "d" : "f");
      mix(e.content);
    }
    st.hash = h;
    return st;
  }

  // Writes a state into the empty directory dir. False (with errno set) on failure.
  static bool Materialize(const State& st, const std::string& dir) {
    for (const Entry& e : st.entries) {
      const std::string p = dir + "/" + e.path;
      if (e.dir) {
        if (::mkdir(p.c_str(), 0755) != 0) return false;
        continue;
      }
      int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd < 0) return false;
      size_t done = 0;
      while (done < e.content.size()) {
        ssize_t r = ::write(fd, e.content.data() + done, e.content.size() - done);
        if (r <= 0) {
          ::close(fd);
          return false;
        }
        done += static_cast<size_t>(r);
      }
      if (::close(fd) != 0) return false;
    }
    return true;
  }

  // The last few calls before crash point k, for failure messages.
  std::string Tail(size_t k, size_t n = 12) const {
    std::string s;
    for (size_t i = k > n ? k - n : 0; i < k && i < ops_.size(); ++i) {
      const alpsck::RecordedOp& o = ops_[i];
      s += "  #" + std::to_string(i) + " " + alpsck::RecordedOpName(o.kind) + " " +
           (o.kind == alpsck::RecordedOp::Kind::kMark ? o.label + " " + std::to_string(o.value) : Short(o.path)) +
           (o.path2.empty() ? "" : " -> " + Short(o.path2)) + (o.fd >= 0 ? " fd " + std::to_string(o.fd) : "") +
           (o.length ? " len " + std::to_string(o.length) : "") + "\n";
    }
    return s;
  }

 private:
  std::string Short(const std::string& p) const {
    return p.compare(0, root_.size(), root_) == 0 ? "RUN" + p.substr(root_.size()) : p;
  }

  std::string Content(size_t k, const Policy& policy, int inode) const {
    const Inode& n = inodes_[static_cast<size_t>(inode)];
    size_t last_sync = 0;
    for (size_t s : n.syncs)
      if (s < k) last_sync = std::max(last_sync, s);
    std::string c;
    for (const DataOp& d : n.data) {
      if (d.at >= k) break;
      Fate f = d.at < last_sync ? Fate::kApply : policy.data_fate(inode, d);
      if (f == Fate::kDrop) continue;
      switch (d.kind) {
        case DataOp::kTruncate: c.resize(static_cast<size_t>(d.length), '\0'); break;
        case DataOp::kExtend:
          if (c.size() < d.length) c.resize(static_cast<size_t>(d.length), '\0');
          break;
        case DataOp::kWrite: {
          const uint64_t end = d.offset + d.length;
          uint64_t b = 0;
          for (uint64_t seg = d.offset; seg < end; ++b) {
            const uint64_t seg_end = std::min(end, (seg / kBlock + 1) * kBlock);
            if (f == Fate::kApply || policy.keep_block(inode, d, b)) {
              if (c.size() < seg_end) c.resize(static_cast<size_t>(seg_end), '\0');
              // memcpy, not iterator copies: this is the hot loop, also in -O0 sanitizer builds.
              std::memcpy(&c[static_cast<size_t>(seg)], d.data->data() + (seg - d.offset),
                          static_cast<size_t>(seg_end - seg));
            }
            seg = seg_end;
          }
          break;
        }
      }
    }
    return c;
  }

  void Walk(size_t k, const Policy& policy, int dir, const std::string& prefix, std::vector<bool>* seen,
            State* st) const {
    const Inode& n = inodes_[static_cast<size_t>(dir)];
    size_t synced, total;
    Counts(n, k, &synced, &total);
    size_t keep = std::clamp(policy.dir_keep(dir, synced, total), synced, total);
    std::map<std::string, int> entries;
    size_t applied = 0;
    for (const DirOp& d : n.entries) {
      if (d.at >= k || applied == keep) break;
      ++applied;
      switch (d.kind) {
        case DirOp::kAdd: entries[d.name] = d.inode; break;
        case DirOp::kRemove: entries.erase(d.name); break;
        case DirOp::kRename: {
          auto it = entries.find(d.name);
          if (it == entries.end()) break;  // cannot happen: a prefix replays the live order
          int child = it->second;
          entries.erase(it);
          entries[d.name2] = child;
          break;
        }
      }
    }
    for (const auto& [name, child] : entries) {
      if ((*seen)[static_cast<size_t>(child)]) continue;  // one name per inode (no hard links)
      (*seen)[static_cast<size_t>(child)] = true;
      Entry e;
      e.path = prefix + name;
      e.dir = inodes_[static_cast<size_t>(child)].dir;
      if (!e.dir) e.content = Content(k, policy, child);
      st->entries.push_back(std::move(e));
      if (inodes_[static_cast<size_t>(child)].dir) Walk(k, policy, child, prefix + name + "/", seen, st);
    }
  }

  std::string root_;
  std::vector<alpsck::RecordedOp> ops_;
  std::vector<Inode> inodes_;
};

}  // namespace alpsck_test

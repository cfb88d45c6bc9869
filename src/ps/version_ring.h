// Which versions of a slice a store keeps for delay compensation, and in which of its rows:
// the bookkeeping both stores share (ps/param_store.h, Compensation). The rows themselves
// (host or device memory, `depth` slice-sized rows) are the store's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ps/param_store.h"

namespace dsync::ps {

class VersionRing {
 public:
  uint32_t depth() const { return static_cast<uint32_t>(rounds_.size()); }

  // The row holding the parameters a gradient computed on version `base` is corrected
  // toward: the parameters before the first kept round >= base changed them (rounds in
  // between changed nothing, or that round would be kept), or the oldest kept when the ring
  // no longer reaches back to `base`. -1 when no kept round is >= base: the slice has not
  // changed since, and there is nothing to correct.
  int32_t RowFor(uint64_t base) const {
    int32_t best = -1;
    for (uint32_t row = 0; row < depth(); ++row) {
      if (!used_[row] || rounds_[row] < base) continue;
      if (best < 0 || rounds_[row] < rounds_[static_cast<uint32_t>(best)]) {
        best = static_cast<int32_t>(row);
      }
    }
    return best;
  }

  // Each of a round's `gradients` gradients' row under `comp` (RowFor of its base; -1 where
  // it is not corrected: fresh, or no factor) into `rows`; true when any gradient is. Before
  // RowToKeep's row is written: the round's own row may be one of these.
  bool RowsFor(const Compensation& comp, size_t gradients, std::vector<int32_t>& rows) const {
    bool corrects = false;
    rows.assign(gradients, -1);
    for (size_t k = 0; k < comp.bases.size() && comp.lambda != 0.0f; ++k) {
      rows[k] = RowFor(comp.bases[k]);
      corrects = corrects || rows[k] >= 0;
    }
    return corrects;
  }

  // The row the parameters before the next round go into: a free one, or the oldest kept's.
  // It may be one a gradient of that round is corrected toward, which the store reads before
  // it overwrites it, element by element. -1 with depth 0.
  int32_t RowToKeep() const {
    if (depth() == 0) return -1;
    uint32_t row = 0;
    for (uint32_t r = 0; r < depth(); ++r) {
      if (!used_[r]) return static_cast<int32_t>(r);
      if (rounds_[r] < rounds_[row]) row = r;
    }
    return static_cast<int32_t>(row);
  }

  // Records that `row` (RowToKeep's) now holds the parameters before `round`: call once the
  // store wrote it, after every RowFor of the round.
  void Kept(int32_t row, uint64_t round) {
    if (row < 0 || static_cast<uint32_t>(row) >= depth()) return;
    used_[static_cast<uint32_t>(row)] = true;
    rounds_[static_cast<uint32_t>(row)] = round;
  }

  // The kept rounds' rows, oldest first.
  std::vector<uint32_t> RowsOldestFirst() const {
    std::vector<uint32_t> rows;
    for (uint32_t r = 0; r < depth(); ++r) {
      if (used_[r]) rows.push_back(r);
    }
    std::sort(rows.begin(), rows.end(), [&](uint32_t a, uint32_t b) { return rounds_[a] < rounds_[b]; });
    return rows;
  }
  uint64_t RoundOf(uint32_t row) const { return rounds_[row]; }

  // The rows a ring re-laid to `depth` rows keeps: the newest `depth` kept, oldest first. The
  // store copies them into rows 0, 1, ... of its new rows and calls Assign with their rounds.
  std::vector<uint32_t> RowsKeptAt(uint32_t depth) const {
    std::vector<uint32_t> rows = RowsOldestFirst();
    if (rows.size() > depth) rows.erase(rows.begin(), rows.end() - depth);
    return rows;
  }

  // A ring of `depth` rows holding `rounds` (oldest first, at most `depth`) in rows 0, 1, ...
  void Assign(uint32_t depth, const std::vector<uint64_t>& rounds) {
    rounds_.assign(depth, 0);
    used_.assign(depth, false);
    for (size_t i = 0; i < rounds.size() && i < depth; ++i) {
      rounds_[i] = rounds[i];
      used_[i] = true;
    }
  }

 private:
  std::vector<uint64_t> rounds_;  // per row: the round whose "before" it holds
  std::vector<bool> used_;
};

}  // namespace dsync::ps

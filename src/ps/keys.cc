#include "ps/keys.h"

#include <sodium.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace dsync::ps {
namespace {

void InitSodium() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Fails only when no system RNG can be opened; nothing secure can be done then.
    if (sodium_init() < 0) std::abort();
  });
}

// What each tag is of: the first word of every PRF input, so no two kinds of tag collide.
enum class Domain : uint64_t {
  kClientCredential = 1,
  kServerProof = 2,
  kReceipt = 3,
  kSchedulerProof = 4,
};

template <size_t N>
Tag Prf(const JobKey& key, Domain domain, const std::array<uint64_t, N>& fields) {
  static_assert(crypto_shorthash_siphashx24_KEYBYTES == sizeof(JobKey));
  static_assert(crypto_shorthash_siphashx24_BYTES == sizeof(Tag));
  std::array<uint64_t, N + 1> in;
  in[0] = static_cast<uint64_t>(domain);
  std::copy(fields.begin(), fields.end(), in.begin() + 1);
  Tag out;
  crypto_shorthash_siphashx24(out.data(), reinterpret_cast<const unsigned char*>(in.data()),
                              sizeof(in), key.data());
  return out;
}

template <typename Bytes>
std::optional<Bytes> FromHex(std::string_view hex) {
  Bytes out{};
  if (hex.size() != 2 * out.size()) return std::nullopt;
  size_t len = 0;
  if (sodium_hex2bin(out.data(), out.size(), hex.data(), hex.size(), nullptr, &len, nullptr) !=
          0 ||
      len != out.size()) {
    return std::nullopt;
  }
  return out;
}

}  // namespace

JobKey RandomJobKey() {
  InitSodium();
  JobKey k;
  randombytes_buf(k.data(), k.size());
  return k;
}

std::string RandomToken() {
  InitSodium();
  std::array<uint8_t, 16> b;
  randombytes_buf(b.data(), b.size());
  return ToHex(b);
}

std::string ToHex(std::span<const uint8_t> bytes) {
  std::string s(bytes.size() * 2 + 1, '\0');
  sodium_bin2hex(s.data(), s.size(), bytes.data(), bytes.size());
  s.pop_back();
  return s;
}

std::optional<JobKey> JobKeyFromHex(std::string_view hex) { return FromHex<JobKey>(hex); }
std::optional<Tag> TagFromHex(std::string_view hex) { return FromHex<Tag>(hex); }

bool TagsEqual(const Tag& a, const Tag& b) {
  InitSodium();
  return sodium_memcmp(a.data(), b.data(), a.size()) == 0;
}

Tag ClientCredential(const JobKey& key, NodeId id, bool observer) {
  return Prf<2>(key, Domain::kClientCredential, {id, observer ? 1u : 0u});
}

Tag ServerProof(const JobKey& key, NodeId server, NodeId client) {
  return Prf<2>(key, Domain::kServerProof, {server, client});
}

Tag SchedulerProof(const JobKey& secret, NodeId node, const Tag& nonce) {
  uint64_t lo, hi;
  std::memcpy(&lo, nonce.data(), sizeof lo);
  std::memcpy(&hi, nonce.data() + sizeof lo, sizeof hi);
  return Prf<3>(secret, Domain::kSchedulerProof, {node, lo, hi});
}

Tag RandomNonce() {
  InitSodium();
  Tag t;
  randombytes_buf(t.data(), t.size());
  return t;
}

Tag Receipt(const JobKey& key, const ReceiptFields& f) {
  return Prf<6>(key, Domain::kReceipt,
                {f.server, f.worker, f.clock, f.tensor, f.slices, f.first_rank});
}

}  // namespace dsync::ps

#include "ps/keys.h"

#include <sodium.h>

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

// Domain-separated PRF over a few integers: BLAKE2b keyed with the job key, 16 bytes out.
template <size_t N>
Tag Prf(const JobKey& key, std::string_view domain, const std::array<uint64_t, N>& fields) {
  InitSodium();
  crypto_generichash_state st;
  crypto_generichash_init(&st, key.data(), key.size(), Tag{}.size());
  crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(domain.data()),
                            domain.size());
  const unsigned char sep = 0;  // the domain ends here: no domain is a prefix of another
  crypto_generichash_update(&st, &sep, 1);
  crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(fields.data()),
                            sizeof(uint64_t) * N);
  Tag out;
  crypto_generichash_final(&st, out.data(), out.size());
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
  return Prf<2>(key, "dsyncps client credential", {id, observer ? 1u : 0u});
}

Tag ServerProof(const JobKey& key, NodeId server, NodeId client) {
  return Prf<2>(key, "dsyncps server proof", {server, client});
}

Tag Receipt(const JobKey& key, const ReceiptFields& f) {
  return Prf<6>(key, "dsyncps push receipt",
                {f.server, f.worker, f.clock, f.tensor, f.slices, f.first_rank});
}

}  // namespace dsync::ps

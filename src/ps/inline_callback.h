// A move-only callable with inline storage: a completion callback that never touches the
// heap, whatever it captures (up to N bytes, checked at compile time). std::function
// allocates once a capture exceeds its small buffer (16 bytes in libstdc++), which would put
// an allocation on every pull reply.
#pragma once

#include <cstddef>
#include <new>
#include <type_traits>
#include <utility>

namespace dsync::ps {

template <typename Signature, size_t N>
class InlineCallback;

template <typename R, typename... Args, size_t N>
class InlineCallback<R(Args...), N> {
 public:
  InlineCallback() = default;
  InlineCallback(std::nullptr_t) {}  // NOLINT: implicit like std::function's

  template <typename F, typename D = std::decay_t<F>,
            typename = std::enable_if_t<!std::is_same_v<D, InlineCallback> &&
                                        !std::is_same_v<D, std::nullptr_t>>>
  InlineCallback(F&& f) {  // NOLINT: implicit like std::function's
    static_assert(sizeof(D) <= N, "capture too large for the inline callback; capture less");
    static_assert(alignof(D) <= alignof(std::max_align_t));
    static_assert(std::is_nothrow_move_constructible_v<D>);
    new (storage_) D(std::forward<F>(f));
    ops_ = &kOps<D>;
  }

  InlineCallback(InlineCallback&& other) noexcept { MoveFrom(other); }
  InlineCallback& operator=(InlineCallback&& other) noexcept {
    if (this != &other) {
      Reset();
      MoveFrom(other);
    }
    return *this;
  }
  InlineCallback(const InlineCallback&) = delete;
  InlineCallback& operator=(const InlineCallback&) = delete;
  ~InlineCallback() { Reset(); }

  explicit operator bool() const { return ops_ != nullptr; }
  R operator()(Args... args) { return ops_->invoke(storage_, std::forward<Args>(args)...); }

 private:
  struct Ops {
    R (*invoke)(void*, Args...);
    void (*move)(void* dst, void* src);  // move-construct into dst, destroy src
    void (*destroy)(void*);
  };
  template <typename D>
  static constexpr Ops kOps = {
      [](void* p, Args... args) -> R { return (*static_cast<D*>(p))(std::forward<Args>(args)...); },
      [](void* dst, void* src) {
        new (dst) D(std::move(*static_cast<D*>(src)));
        static_cast<D*>(src)->~D();
      },
      [](void* p) { static_cast<D*>(p)->~D(); }};

  void Reset() {
    if (ops_) ops_->destroy(storage_);
    ops_ = nullptr;
  }
  void MoveFrom(InlineCallback& other) {
    if (other.ops_) other.ops_->move(storage_, other.storage_);
    ops_ = std::exchange(other.ops_, nullptr);
  }

  alignas(std::max_align_t) unsigned char storage_[N];
  const Ops* ops_ = nullptr;
};

}  // namespace dsync::ps

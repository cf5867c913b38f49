// See page_pool.h.
#include "page_pool.h"

#include <chrono>
#include <map>
#include <new>
#include <set>
#include <tuple>

#include "capture.h"

namespace oxygen {

// ---------------------------------------------------------------------------------------------
// DeviceCtx

namespace {
using RegistryKey = std::tuple<std::string, int, std::size_t>;
using Registry = std::map<RegistryKey, std::weak_ptr<DeviceCtx>>;

// Process-wide state, leaked on purpose (used during process exit) and reset in a forked child.
std::mutex g_live_mu;
std::set<DeviceCtx*>* g_live = new std::set<DeviceCtx*>();
std::mutex g_registry_mu;
Registry* g_registry = new Registry();

std::set<DeviceCtx*>& live_ctxs() { return *g_live; }

// The one physical-page context allowed per (kind, device, page size) is bounded by the address
// space: the pool reserves 2 x capacity, and nothing reserves more than 2^56 bytes.
constexpr std::size_t kMaxCapacity = std::size_t{1} << 55;
}  // namespace

void page_pool_after_fork_child() {
  // The parent's contexts stay out of both: nothing in the child may lock or join them.
  new (&g_live_mu) std::mutex();
  new (g_live) std::set<DeviceCtx*>();
  new (&g_registry_mu) std::mutex();
  new (g_registry) Registry();
}

void DeviceCtx::stop_all_threads() {
  std::lock_guard<std::mutex> g(g_live_mu);
  for (DeviceCtx* c : live_ctxs()) c->stop_thread();
}

void DeviceCtx::stop_thread() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

std::shared_ptr<DeviceCtx> DeviceCtx::create(const std::string& kind, int device,
                                             const CtxOptions& opt, Status* status) {
  std::unique_ptr<Backend> be;
  if (kind == "host")
    be = make_host_backend(opt.page_size, status);
  else if (kind == "cuda")
    be = make_cuda_backend(device, status);
  else {
    set_last_error("unknown backend '" + kind + "' (expected host or cuda)");
    *status = ERR_INVALID;
  }
  if (!be) return nullptr;
  if (opt.page_size % be->granularity() != 0) {
    set_last_error("page size " + std::to_string(opt.page_size) +
                   " is not a multiple of the backend granularity " +
                   std::to_string(be->granularity()));
    *status = ERR_INVALID;
    return nullptr;
  }
  std::size_t cap = opt.capacity;
  if (cap > kMaxCapacity) {
    set_last_error("capacity " + std::to_string(cap) + " bytes is larger than any address space "
                   "(the pool reserves twice its capacity; at most 2^55 bytes)");
    *status = ERR_INVALID;
    return nullptr;
  }
  if (cap == 0) {
    std::size_t free_b = 0, total_b = 0;
    if ((*status = be->mem_info(&free_b, &total_b)) != OK) return nullptr;
    double frac = opt.reserve_fraction > 0 && opt.reserve_fraction <= 1 ? opt.reserve_fraction : 0.9;
    cap = static_cast<std::size_t>(static_cast<double>(total_b) * frac);
  }
  std::size_t max_pages = cap / opt.page_size;
  if (max_pages == 0) {
    set_last_error("capacity " + std::to_string(cap) + " is smaller than one page");
    *status = ERR_INVALID;
    return nullptr;
  }
  *status = OK;
  return std::shared_ptr<DeviceCtx>(new DeviceCtx(std::move(be), kind, device, opt, max_pages));
}

std::shared_ptr<DeviceCtx> DeviceCtx::shared(const std::string& kind, int device,
                                             const CtxOptions& opt, Status* status) {
  std::lock_guard<std::mutex> g(g_registry_mu);
  auto key = std::make_tuple(kind, device, opt.page_size);
  if (auto sp = (*g_registry)[key].lock()) {
    *status = OK;
    return sp;
  }
  auto sp = create(kind, device, opt, status);
  if (sp) (*g_registry)[key] = sp;
  return sp;
}

DeviceCtx::DeviceCtx(std::unique_ptr<Backend> be, std::string kind, int device,
                     const CtxOptions& opt, std::size_t max_pages)
    : backend_(std::move(be)),
      generation_(fork_state::generation()),
      kind_(std::move(kind)),
      device_(device),
      page_(opt.page_size),
      max_pages_(max_pages),
      low_(opt.low_pages),
      high_(opt.high_pages < opt.low_pages ? opt.low_pages : opt.high_pages) {
  std::lock_guard<std::mutex> g(g_live_mu);
  live_ctxs().insert(this);
}

DeviceCtx::~DeviceCtx() {
  {
    std::lock_guard<std::mutex> g(g_live_mu);
    live_ctxs().erase(this);
  }
  stop_thread();
  trim(0);
}

void DeviceCtx::start_thread() {
  // Started at the first acquire, not at construction: an idle context holds no memory and no
  // thread. Caller holds mu_.
  if (!thread_.joinable() && !stop_) thread_ = std::thread([this] { run(); });
}

Status DeviceCtx::acquire(PhysHandle* handle) {
  {
    std::unique_lock<std::mutex> g(mu_);
    start_thread();
    refill_paused_ = false;
    created_cv_.wait(g, [this] {
      return !cache_.empty() || owned_.load() < max_pages_ || creating_ == 0;
    });
    if (!cache_.empty()) {
      *handle = cache_.back();
      cache_.pop_back();
      drop(stats_.handle_cache_pages);
      if (cache_.size() < low_) cv_.notify_one();
      return OK;
    }
    if (owned_.load() >= max_pages_) {
      set_last_error("pool capacity reached (" + std::to_string(max_pages_) + " pages of " +
                     std::to_string(page_) + " bytes)");
      return ERR_OOM;
    }
    owned_.fetch_add(1);
    cv_.notify_one();
  }
  // The refill thread was behind: create on this thread, outside the lock.
  Status s = backend_->create(page_, handle);
  if (s != OK) {
    owned_.fetch_sub(1);
    return s;
  }
  bump(stats_.handles_created);
  bump(stats_.handles_created_inline);
  return OK;
}

void DeviceCtx::give_back(PhysHandle handle) {
  std::unique_lock<std::mutex> g(mu_);
  refill_failed_ = false;
  if (cache_.size() < high_ || capture::maybe_active()) {
    cache_.push_back(handle);
    bump(stats_.handle_cache_pages);
    return;
  }
  owned_.fetch_sub(1);
  g.unlock();
  if (backend_->release(handle) == OK) bump(stats_.handles_released);
}

void DeviceCtx::trim(std::size_t keep) {
  std::vector<PhysHandle> out;
  {
    std::unique_lock<std::mutex> g(mu_);
    if (keep == 0) {
      // A handle the refill thread is creating goes back by itself (refill sees the pause); wait
      // for it, or empty_cache() could return with it still alive (a flaky live_handles of 1
      // on a loaded CI machine).
      refill_paused_ = true;
      created_cv_.wait(g, [this] { return creating_ == 0; });
    }
    while (cache_.size() > keep) {
      out.push_back(cache_.back());
      cache_.pop_back();
      drop(stats_.handle_cache_pages);
    }
  }
  for (PhysHandle h : out) {
    owned_.fetch_sub(1);
    if (backend_->release(h) == OK) bump(stats_.handles_released);
  }
}

Status DeviceCtx::prepare(std::size_t pages) {
  for (;;) {
    {
      std::unique_lock<std::mutex> g(mu_);
      created_cv_.wait(g, [&] {
        return cache_.size() >= pages || owned_.load() < max_pages_ || creating_ == 0;
      });
      if (cache_.size() >= pages) return OK;
      if (owned_.load() >= max_pages_) {
        set_last_error("prepare: pool capacity reached");
        return ERR_OOM;
      }
      owned_.fetch_add(1);
    }
    PhysHandle h = 0;
    Status s = backend_->create(page_, &h);
    if (s != OK) {
      owned_.fetch_sub(1);
      return s;
    }
    bump(stats_.handles_created);
    std::lock_guard<std::mutex> g(mu_);
    refill_paused_ = false;  // an explicit request for handles ahead
    cache_.push_back(h);
    bump(stats_.handle_cache_pages);
  }
}

void DeviceCtx::refill() {
  // Creates until the high watermark, one handle per lock round so that acquire() never waits
  // behind a driver call.
  for (;;) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (stop_ || refill_failed_ || refill_paused_ || cache_.size() >= high_ ||
          owned_.load() >= max_pages_)
        return;
      owned_.fetch_add(1);
      ++creating_;
    }
    PhysHandle h = 0;
    Status s = backend_->create(page_, &h);
    std::unique_lock<std::mutex> g(mu_);
    if (s != OK) {
      --creating_;
      owned_.fetch_sub(1);
      refill_failed_ = true;  // device full: the allocating thread will reclaim and report
      created_cv_.notify_all();
      return;
    }
    bump(stats_.handles_created);
    if (refill_paused_) {  // trim(0) ran while this handle was being created: hand it back too
      owned_.fetch_sub(1);
      g.unlock();
      if (backend_->release(h) == OK) bump(stats_.handles_released);
      g.lock();
      --creating_;  // (only now: trim(0) waits for it, so empty_cache() leaves no handle behind)
      created_cv_.notify_all();
      return;
    }
    --creating_;
    cache_.push_back(h);
    bump(stats_.handle_cache_pages);
    created_cv_.notify_all();
  }
}

void DeviceCtx::run() {
  // Refill below the low watermark; every few milliseconds run the sweepers (hysteresis unmaps),
  // so that memory is handed back even when the program stops allocating.
  for (;;) {
    {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait_for(g, std::chrono::milliseconds(5), [this] {
        return stop_ || (!refill_failed_ && !refill_paused_ && cache_.size() < low_ &&
                         owned_.load() < max_pages_);
      });
      if (stop_) return;
    }
    refill();
    std::lock_guard<std::mutex> g(sweep_mu_);
    for (auto& kv : sweepers_) kv.second();
  }
}

void DeviceCtx::add_sweeper(void* key, std::function<void()> fn) {
  std::lock_guard<std::mutex> g(sweep_mu_);
  sweepers_.emplace_back(key, std::move(fn));
}

void DeviceCtx::remove_sweeper(void* key) {
  std::lock_guard<std::mutex> g(sweep_mu_);  // waits for a sweep in progress
  for (auto it = sweepers_.begin(); it != sweepers_.end();)
    it = it->first == key ? sweepers_.erase(it) : it + 1;
}

// ---------------------------------------------------------------------------------------------
// PageRange

PageRange::PageRange(std::shared_ptr<DeviceCtx> ctx, std::size_t pages, Status* status)
    : ctx_(std::move(ctx)) {
  // Address space first: an absurd size fails there, cleanly, before any per-page bookkeeping is
  // allocated (allocating it first turned capacity=2^62 into a std::bad_alloc).
  if (pages == 0 || pages > SIZE_MAX / ctx_->page()) {
    set_last_error("a range of " + std::to_string(pages) + " pages of " +
                   std::to_string(ctx_->page()) + " bytes cannot be addressed");
    *status = ERR_INVALID;
    return;
  }
  if ((*status = ctx_->backend().reserve(pages * ctx_->page(), &base_)) != OK) {
    base_ = 0;
    return;
  }
  try {
    handles_.assign(pages, 0);
    lent_.assign(pages, 0);
    mapped_.reset(new std::atomic<std::uint8_t>[pages]);
  } catch (const std::bad_alloc&) {
    ctx_->backend().free_va(base_, pages * ctx_->page());
    base_ = 0;
    set_last_error("no host memory for the bookkeeping of " + std::to_string(pages) + " pages");
    *status = ERR_OOM;
    return;
  }
  pages_ = pages;
  for (std::size_t i = 0; i < pages; ++i) mapped_[i].store(0, std::memory_order_relaxed);
  bump(ctx_->stats().reserved_va_bytes, pages * ctx_->page());
  bump(ctx_->stats().live_ranges);
}

PageRange::~PageRange() {
  if (!base_) return;
  for (std::size_t i = 0; i < pages_; ++i)
    if (is_mapped(i)) unmap_one(i);
  ctx_->backend().free_va(base_, pages_ * page());
  drop(ctx_->stats().reserved_va_bytes, pages_ * page());
  drop(ctx_->stats().live_ranges);
}

Status PageRange::map_one(std::size_t i) {
  PhysHandle h = 0;
  Status s = ctx_->acquire(&h);
  if (s != OK) return s;
  s = ctx_->backend().map(base_ + i * page(), page(), h);
  if (s != OK) {
    ctx_->give_back(h);
    return s;
  }
  handles_[i] = h;
  return OK;
}

Status PageRange::map(std::size_t first, std::size_t count) {
  if (!in_range(first, count)) {
    set_last_error("map: pages [" + std::to_string(first) + ", +" + std::to_string(count) +
                   ") out of range; the range has " + std::to_string(pages_) + " pages");
    return ERR_INVALID;
  }
  for (std::size_t i = first; i < first + count; ++i)
    if (is_mapped(i)) {
      set_last_error("map: page " + std::to_string(i) + " is already mapped");
      return ERR_INVALID;
    }
  std::uint64_t t0 = now_ns();
  std::size_t done = 0;
  Status s = OK;
  while (done < count && (s = map_one(first + done)) == OK) ++done;
  // One set-access over the whole run: fewer driver calls (the H200 showed no per-page saving).
  if (s == OK) s = ctx_->backend().set_access(base_ + first * page(), count * page());
  if (s != OK) {
    for (std::size_t i = first; i < first + done; ++i) {
      ctx_->backend().unmap(base_ + i * page(), page());
      ctx_->give_back(handles_[i]);
      handles_[i] = 0;
    }
    return s;
  }
  std::uint64_t per_page = (now_ns() - t0) / count;
  PhysCounters& st = ctx_->stats();
  for (std::size_t i = first; i < first + count; ++i) mapped_[i].store(1, std::memory_order_release);
  nmapped_.fetch_add(count, std::memory_order_relaxed);
  bump(st.num_maps, count);
  bump(st.map_ns, per_page * count);
  bump(moves_.maps, count);
  bump(moves_.map_ns, per_page * count);
  bump(st.map_hist[latency_bucket(per_page)], count);
  bump(st.mapped_bytes, count * page());
  raise_peak(st.peak_mapped_bytes, get(st.mapped_bytes));
  return OK;
}

void PageRange::unmap_one(std::size_t i) {
  std::uint64_t t0 = now_ns();
  Status s = ctx_->backend().unmap(base_ + i * page(), page());
  mapped_[i].store(0, std::memory_order_release);
  nmapped_.fetch_sub(1, std::memory_order_relaxed);
  PhysCounters& st = ctx_->stats();
  std::uint64_t took = now_ns() - t0;
  bump(st.num_unmaps);
  bump(st.unmap_ns, took);
  bump(moves_.unmaps);
  bump(moves_.unmap_ns, took);
  if (lent_[i]) {  // the handle (and its bytes) belong to the borrower now
    lent_[i] = 0;
  } else {
    drop(st.mapped_bytes, page());
    // A handle whose unmap failed may still be mapped: leak it rather than reuse it.
    if (s == OK) ctx_->give_back(handles_[i]);
  }
  handles_[i] = 0;
}

Status PageRange::lend(std::size_t src, std::size_t dst) {
  if (src >= pages_ || dst >= pages_ || !is_mapped(src) || is_mapped(dst) || lent_[src]) {
    set_last_error("lend: page " + std::to_string(src) + " cannot lend to " + std::to_string(dst));
    return ERR_INVALID;
  }
  std::uint64_t t0 = now_ns();
  std::uintptr_t va = base_ + dst * page();
  Status s = ctx_->backend().map(va, page(), handles_[src]);
  if (s == OK && (s = ctx_->backend().set_access(va, page())) != OK)
    ctx_->backend().unmap(va, page());
  if (s != OK) return s;
  handles_[dst] = handles_[src];
  lent_[src] = 1;
  mapped_[dst].store(1, std::memory_order_release);
  nmapped_.fetch_add(1, std::memory_order_relaxed);
  PhysCounters& st = ctx_->stats();
  std::uint64_t ns = now_ns() - t0;
  bump(st.num_maps);
  bump(st.map_ns, ns);
  bump(st.map_hist[latency_bucket(ns)]);
  bump(moves_.maps);
  bump(moves_.map_ns, ns);
  return OK;
}

Status PageRange::unmap(std::size_t first, std::size_t count) {
  if (!in_range(first, count)) {
    set_last_error("unmap: pages [" + std::to_string(first) + ", +" + std::to_string(count) +
                   ") out of range; the range has " + std::to_string(pages_) + " pages");
    return ERR_INVALID;
  }
  for (std::size_t i = first; i < first + count; ++i)
    if (!is_mapped(i)) {
      set_last_error("unmap: page " + std::to_string(i) + " is not mapped");
      return ERR_INVALID;
    }
  for (std::size_t i = first; i < first + count; ++i) unmap_one(i);
  return OK;
}

}  // namespace oxygen

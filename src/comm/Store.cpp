// comm::Store over c10d's TCPStore.
#include "dtrain/comm/Store.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "dtrain/common/Error.h"

namespace dtrain::comm {

struct Store::Impl {
  c10::intrusive_ptr<c10d::Store> store;
};

namespace {

std::vector<uint8_t> bytes_of(const std::string& text) { return {text.begin(), text.end()}; }
std::string text_of(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }

}  // namespace

Store::Store(const Options& options) : options_(options), impl_(std::make_unique<Impl>()) {
  DTRAIN_CHECK_INPUT(options.port > 0 && options.port < 65536,
                     "store port must be in 1..65535, got ", options.port);
  c10d::TCPStoreOptions tcp;
  tcp.port = static_cast<uint16_t>(options.port);
  tcp.isServer = options.is_server;
  tcp.waitWorkers = false;
  tcp.timeout = options.timeout;
  try {
    impl_->store = c10::make_intrusive<c10d::TCPStore>(options.host, tcp);
  } catch (const std::exception& e) {
    DTRAIN_THROW(CommError, "could not ", options.is_server ? "host" : "reach",
                 " the rendezvous store at ", address(), " within ",
                 options.timeout.count() / 1000.0, " s: ", first_line(e.what()));
  }
}

Store::~Store() = default;

std::string Store::address() const { return concat(options_.host, ":", options_.port); }

void* Store::native() const { return &impl_->store; }

namespace {

// Runs one store call, turning c10d's errors into a CommError naming the store and the call.
template <typename Call>
auto guarded(const std::string& address, const std::string& op, Call&& call) -> decltype(call()) {
  try {
    return call();
  } catch (const std::exception& e) {
    DTRAIN_THROW(CommError, "rendezvous store ", address, ": ", op,
                 " failed: ", first_line(e.what()));
  }
}

}  // namespace

void Store::set(const std::string& key, const std::string& value) {
  guarded(address(), "set(" + key + ")", [&] { impl_->store->set(key, bytes_of(value)); });
}

std::string Store::get(const std::string& key) {
  return guarded(address(), "get(" + key + ")", [&] { return text_of(impl_->store->get(key)); });
}

int64_t Store::add(const std::string& key, int64_t delta) {
  return guarded(address(), "add(" + key + ")", [&] { return impl_->store->add(key, delta); });
}

bool Store::check(const std::string& key) {
  return guarded(address(), "check(" + key + ")", [&] { return impl_->store->check({key}); });
}

std::string Store::set_if_absent(const std::string& key, const std::string& value) {
  return guarded(address(), "compare_set(" + key + ")",
                 [&] { return text_of(impl_->store->compareSet(key, {}, bytes_of(value))); });
}

}  // namespace dtrain::comm

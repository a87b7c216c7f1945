// What PyTorch asks only of a C++ backend, for the `neuron` device (PrivateUse1): the device
// guard (current core per thread, streams), and the hooks (pinned host memory, generators,
// primary context). Python stays the engine: it tells this file how many cores the process
// sees and answers two callbacks (sync a core; a core's random generator). See README.md
// beside this file; built at first import by adaptive_eager/integration/native.py.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/csrc/utils/disable_torch_function.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <map>
#include <mutex>

namespace py = pybind11;

namespace {

constexpr c10::DeviceType kNeuron = c10::DeviceType::PrivateUse1;
constexpr int kMaxCores = 64;

std::atomic<int> g_count{1};                 // cores this process sees (set by Python)
thread_local c10::DeviceIndex t_current = 0;  // the current core, per thread (as CUDA)
std::atomic<int64_t> g_stream[kMaxCores];     // each core's current stream id (0: default)
std::atomic<int64_t> g_next_stream{1};        // ids of new streams (shared with Python)

// Python callbacks, set once by install(); called with the GIL taken.
py::object* g_sync = nullptr;  // sync(k): wait for everything queued on core k
py::object* g_rng = nullptr;   // rng(k): flush core k's random ops; its CPU generator

void check_index(c10::DeviceIndex k) {
  int n = g_count.load();
  TORCH_CHECK(k >= 0 && k < n, "neuron:", static_cast<int>(k), " does not exist: this process "
              "sees ", n, " NeuronCore", n == 1 ? "" : "s", " (neuron:0..", n - 1,
              "; see NEURON_RT_VISIBLE_CORES / NEURON_RT_NUM_CORES)");
}

c10::DeviceIndex resolve(c10::DeviceIndex k) {
  if (k < 0) return t_current;
  check_index(k);
  return k;
}

void call_sync(c10::DeviceIndex k) {
  if (g_sync == nullptr || Py_IsFinalizing()) return;
  py::gil_scoped_acquire gil;
  (*g_sync)(static_cast<int>(k));
}

// -- device guard ------------------------------------------------------------------------
struct NeuronGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNeuron; }

  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kNeuron, t_current); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kNeuron, "expected a neuron device, got ", d);
    if (d.index() < 0) return;  // "neuron" with no index: the current core stays
    check_index(d.index());
    t_current = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < g_count.load()) t_current = d.index();
  }

  // Streams: ids of the engine's streams (torch.neuron.Stream.stream_id). They multiplex
  // onto the core's one hardware queue, which keeps order, so waiting on an event or a
  // stream is only a sync of the core.
  static c10::Stream make(c10::DeviceIndex k, int64_t id) {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kNeuron, k), id);
  }
  c10::Stream getStream(c10::Device d) const override {
    auto k = d.index() < 0 ? t_current : d.index();
    return make(k, g_stream[k].load());
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return make(d.index() < 0 ? t_current : d.index(), 0);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return getNewStream(d, 0);
  }
  c10::Stream getNewStream(c10::Device d, int) const override {
    return make(d.index() < 0 ? t_current : d.index(), g_next_stream++);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto old = getStream(s.device());
    g_stream[s.device_index()].store(s.id());
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(g_count.load());
  }

  // Events: nothing to record on one in-order queue; a wait is a sync of the core.
  void record(void** event, const c10::Stream&, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    if (*event == nullptr) *event = reinterpret_cast<void*>(1);  // recorded, holds nothing
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream& s) const override { call_sync(s.device_index()); }
  void synchronizeEvent(void*) const override { call_sync(t_current); }
  void synchronizeDevice(const c10::DeviceIndex k) const override {
    call_sync(k < 0 ? t_current : k);
  }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};

NeuronGuard g_guard;

// -- pinned host memory ---------------------------------------------------------------------
// On the simulator page-locked memory buys nothing (a host-to-device copy costs the modeled
// DMA time either way): pinned memory is an ordinary host allocation, remembered as pinned.
std::mutex g_pinned_mu;
std::map<const char*, size_t> g_pinned;  // start -> size of each live pinned allocation

void pinned_free(void* p) {
  {
    std::lock_guard<std::mutex> lock(g_pinned_mu);
    g_pinned.erase(static_cast<const char*>(p));
  }
  c10::free_cpu(p);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = c10::alloc_cpu(n == 0 ? 1 : n);  // a distinct address even when empty
    {
      std::lock_guard<std::mutex> lock(g_pinned_mu);
      g_pinned[static_cast<const char*>(p)] = n;
    }
    return {p, p, &pinned_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &pinned_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

PinnedAllocator g_pinned_allocator;

bool is_pinned_ptr(const void* data) {
  if (data == nullptr) return false;
  auto p = static_cast<const char*>(data);
  std::lock_guard<std::mutex> lock(g_pinned_mu);
  auto it = g_pinned.upper_bound(p);
  if (it == g_pinned.begin()) return false;
  --it;
  return p < it->first + std::max<size_t>(it->second, 1);
}

// -- generators -------------------------------------------------------------------------------
// A neuron generator draws as a CPU generator (MT19937) does, so a neuron tensor drawn under a
// seed equals the CPU tensor drawn under it. The default generator of neuron:k has no state of
// its own: it is core k's device RNG (torch.neuron.get_rng_state(k)), reached through Python,
// which first runs the random ops still queued on that core. A new one holds a CPU generator.
struct NeuronGenerator final : c10::GeneratorImpl {
  NeuronGenerator(c10::DeviceIndex k, bool is_default)
      : c10::GeneratorImpl(c10::Device(kNeuron, k), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        is_default_(is_default) {
    if (!is_default) own_ = at::make_generator<at::CPUGeneratorImpl>(c10::default_rng_seed_val);
  }

  // The CPU generator that holds this one's state (the device RNG's for a default one).
  at::Generator cpu() const {
    if (!is_default_) return own_;
    TORCH_CHECK(g_rng != nullptr, "the neuron device's generators are not installed");
    py::gil_scoped_acquire gil;
    return (*g_rng)(static_cast<int>(device().index())).cast<at::Generator>();
  }

  void set_current_seed(uint64_t seed) override {
    auto g = cpu();
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_current_seed(seed);
  }
  void set_offset(uint64_t offset) override {
    auto g = cpu();
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_offset(offset);
  }
  uint64_t get_offset() const override {
    auto g = cpu();
    std::lock_guard<std::mutex> lock(g.mutex());
    return g.get_offset();
  }
  uint64_t current_seed() const override {
    auto g = cpu();
    std::lock_guard<std::mutex> lock(g.mutex());
    return g.current_seed();
  }
  uint64_t seed() override {
    auto g = cpu();
    std::lock_guard<std::mutex> lock(g.mutex());
    return g.seed();
  }
  void set_state(const c10::TensorImpl& state) override {
    auto g = cpu();
    std::lock_guard<std::mutex> lock(g.mutex());
    g.unsafeGetGeneratorImpl()->set_state(state);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    auto g = cpu();
    std::lock_guard<std::mutex> lock(g.mutex());
    return g.unsafeGetGeneratorImpl()->get_state();
  }
  static c10::DeviceType device_type() { return kNeuron; }

  bool is_default_;
  at::Generator own_;

 private:
  NeuronGenerator* clone_impl() const override {  // a new generator with this one's state
    auto out = new NeuronGenerator(device().index(), false);
    auto g = cpu();
    std::lock_guard<std::mutex> lock(g.mutex());
    out->own_ = g.clone();
    return out;
  }
};

std::vector<at::Generator>& default_generators() {
  static std::vector<at::Generator> gens;
  return gens;
}
std::mutex g_gen_mu;

// -- hooks ----------------------------------------------------------------------------------
struct NeuronHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return g_guard.deviceCount(); }
  void setCurrentDevice(c10::DeviceIndex k) const override {
    g_guard.setDevice(c10::Device(kNeuron, k));
  }
  c10::DeviceIndex getCurrentDevice() const override { return t_current; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex k) const override {
    return g_guard.exchangeDevice(c10::Device(kNeuron, k)).index();
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex k) const override {
    return exchangeDevice(k);
  }
  bool isPinnedPtr(const void* data) const override { return is_pinned_ptr(data); }
  at::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_allocator; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex k) const override {
    k = resolve(k);
    std::lock_guard<std::mutex> lock(g_gen_mu);
    auto& gens = default_generators();
    if (gens.empty())
      for (int i = 0; i < kMaxCores; ++i)
        gens.push_back(at::make_generator<NeuronGenerator>(static_cast<c10::DeviceIndex>(i), true));
    return gens[k];
  }
  at::Generator getNewGenerator(c10::DeviceIndex k) const override {
    return at::make_generator<NeuronGenerator>(resolve(k), false);
  }
};

NeuronHooks g_hooks;

// -- what Python calls ------------------------------------------------------------------------
void install(int count, py::object sync, py::object rng) {
  TORCH_CHECK(count >= 1 && count <= kMaxCores, "neuron: bad core count ", count);
  g_count.store(count);
  if (g_sync == nullptr) {  // once per process; kept alive for the process's life
    g_sync = new py::object(std::move(sync));
    g_rng = new py::object(std::move(rng));
  }
  if (!c10::impl::hasDeviceGuardImpl(kNeuron))
    c10::impl::registerDeviceGuard(kNeuron, &g_guard);
  if (!at::isPrivateUse1HooksRegistered())
    at::RegisterPrivateUse1HooksInterface(&g_hooks);
}

bool installed() {
  return c10::impl::hasDeviceGuardImpl(kNeuron) &&
      c10::impl::getDeviceGuardImpl(kNeuron) == &g_guard && at::isPrivateUse1HooksRegistered() &&
      &at::detail::getPrivateUse1Hooks() == &g_hooks;
}

// For an op given a neuron generator: the CPU generator that draws its numbers (the engine
// runs random ops with CPU kernels), and whether it is a core's default one.
py::tuple generator_info(const at::Generator& g) {
  TORCH_CHECK(g.device().type() == kNeuron, "expected a neuron generator, got one for ",
              g.device());
  auto impl = dynamic_cast<NeuronGenerator*>(g.unsafeGetGeneratorImpl());
  TORCH_CHECK(impl != nullptr, "this neuron generator was not made by adaptive_eager");
  return py::make_tuple(static_cast<int>(g.device().index()), impl->is_default_,
                        impl->is_default_ ? py::none() : py::cast(impl->own_));
}

// -- host kernels ---------------------------------------------------------------------------
// Note [Host calls] in fusion/host.py: `host_call(fn, *args)` is `fn(*args)` under
// fusion.host.host_kernels()'s dispatch keys, in one C call (the Python guard costs several
// pybind calls per eager launch). Inside a __torch_dispatch__ (Conjugate excluded): the
// thread's keys, with the view keys (Conjugate, Negative, ZeroTensor) back on and the Python
// keys (Python, PythonTLSSnapshot) off; outside: torch._C._DisableTorchDispatch's keys off.
// The keys are restored on return, by value or by exception.
PyObject* host_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "host_call(fn, *args) needs a function");
    return nullptr;
  }
  auto local = c10::impl::tls_local_dispatch_key_set();
  if (local.excluded_.has(c10::DispatchKey::Conjugate)) {
    const c10::DispatchKeySet view_keys({c10::DispatchKey::Conjugate, c10::DispatchKey::Negative,
                                         c10::DispatchKey::ZeroTensor});
    const c10::DispatchKeySet python_keys({c10::DispatchKey::Python,
                                           c10::DispatchKey::PythonTLSSnapshot});
    c10::impl::ForceDispatchKeyGuard guard(local.included_,
                                           (local.excluded_ - view_keys) | python_keys);
    return PyObject_Vectorcall(args[0], args + 1, nargs - 1, nullptr);
  }
  torch::DisableTorchDispatch guard;
  return PyObject_Vectorcall(args[0], args + 1, nargs - 1, nullptr);
}

PyMethodDef g_host_call_def = {"host_call", reinterpret_cast<PyCFunction>(
    reinterpret_cast<void (*)()>(&host_call)), METH_FASTCALL,
    "host_call(fn, *args): fn(*args) under fusion.host.host_kernels()'s dispatch keys"};

// -- zero tensors ---------------------------------------------------------------------------
// Note [Zero tensors] in adaptive_eager/integration/registration.py: autograd's known-zero
// tensors (`_efficientzerotensor`) carry the ZeroTensor dispatch key, whose kernels skip the
// arithmetic (0 * inf is 0, x + 0 keeps -0.0). TensorImpl's only setter refuses to add it
// (`_set_zero(true)` asserts: CPU and CUDA make theirs inside ATen), so the key set, protected,
// is reached through a subclass's member pointer.
struct KeySetOf : c10::TensorImpl {
  using c10::TensorImpl::key_set_;
};

void mark_zero(const at::Tensor& t) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  impl->*(&KeySetOf::key_set_) = impl->key_set().add(c10::DispatchKey::ZeroTensor);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mark_zero", &mark_zero, "add the ZeroTensor dispatch key to a tensor (Note [Zero tensors])");
  m.def("install", &install, "register the device guard and hooks for PrivateUse1");
  m.def("installed", &installed);
  m.def("current_device", []() { return static_cast<int>(t_current); });
  m.def("set_device", [](int k, int count) {  // (the count: settings may have changed it)
    g_count.store(count);
    g_guard.setDevice(c10::Device(kNeuron, static_cast<c10::DeviceIndex>(k)));
  });
  m.def("set_stream", [](int k, int64_t id) { g_stream[k].store(id); });
  m.def("current_stream", [](int k) { return g_stream[k].load(); });
  m.def("new_stream_id", []() { return g_next_stream++; });
  m.def("generator_info", &generator_info);
  m.def("default_generator", [](int k) {  // torch.neuron.default_generators[k]
    return g_hooks.getDefaultGenerator(static_cast<c10::DeviceIndex>(k));
  });
  m.attr("host_call") = py::reinterpret_steal<py::object>(PyCFunction_New(&g_host_call_def, nullptr));
  m.def("is_pinned_ptr", [](uintptr_t p) { return is_pinned_ptr(reinterpret_cast<void*>(p)); });
}

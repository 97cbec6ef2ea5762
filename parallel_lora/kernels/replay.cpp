// A replayed LoRA call in C++: the forward's recorded program, an autograd node, the backward's program.
// program.py records the programs; docs/kernels.md, "Replaying a call in C++", says what this file owns.
#include <Python.h>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <cstring>
#include <string_view>
#include <unordered_map>
#include <vector>

using at::Tensor;
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

namespace {

PyObject* raw_stream = nullptr;  // torch._C._cuda_getCurrentRawStream; null on a build without CUDA
PyObject* parameter_type = nullptr;  // torch.nn.Parameter

struct Gil {  // holds the GIL for a scope (the backward runs on autograd's threads)
  PyGILState_STATE state = PyGILState_Ensure();
  ~Gil() {
    PyGILState_Release(state);
  }
};

struct Ref {  // an owned PyObject*, released under the GIL
  PyObject* p = nullptr;
  Ref() = default;
  explicit Ref(PyObject* o) : p(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  ~Ref() {
    if (p != nullptr && Py_IsInitialized()) {
      PyGILState_STATE s = PyGILState_Ensure();
      Py_DECREF(p);
      PyGILState_Release(s);
    }
  }
};

[[noreturn]] void raise_python() {
  throw python_error();
}

PyObject* check(PyObject* o) {
  if (o == nullptr) {
    raise_python();
  }
  return o;
}

// The program ``by_stream`` holds for x's current stream, if any (borrowed).
PyObject* stream_program(PyObject* by_stream, const Tensor& x) {
  PyObject* stream;
  if (x.is_cuda()) {
    PyObject* index = check(PyLong_FromLong(x.get_device()));
    stream = PyObject_CallOneArg(raw_stream, index);
    Py_DECREF(index);
    check(stream);
  } else {
    stream = PyLong_FromLong(0);
  }
  PyObject* program = PyDict_GetItemWithError(by_stream, stream);
  Py_DECREF(stream);
  if (program == nullptr && PyErr_Occurred()) {
    raise_python();
  }
  return program != nullptr && PyTuple_Check(program) ? program : nullptr;
}

int64_t as_int(PyObject* o) {
  int64_t v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) {
    raise_python();
  }
  return v;
}

// program.Program.run: fresh outputs, then each entry called with its picks from one pool of addresses.
// ``first_shape``, where given, replaces the shape of the program's first output (y or dx of a 3-D x).
std::vector<Tensor> run_program(PyObject* program, const std::array<const Tensor*, 6>& operands, PyObject* seed,
                                at::IntArrayRef first_shape) {
  PyObject* allocs = PyTuple_GET_ITEM(program, 1);
  PyObject* consts = PyTuple_GET_ITEM(program, 2);
  PyObject* launches = PyTuple_GET_ITEM(program, 3);
  PyObject* outputs = PyTuple_GET_ITEM(program, 4);
  const Py_ssize_t n_alloc = PyTuple_GET_SIZE(allocs);
  const Py_ssize_t n_out = PyTuple_GET_SIZE(outputs);
  const int64_t first = n_out > 0 && PyTuple_GET_ITEM(outputs, 0) != Py_None ? as_int(PyTuple_GET_ITEM(outputs, 0))
                                                                              : -1;
  std::vector<Tensor> fresh;
  fresh.reserve(n_alloc);
  for (Py_ssize_t i = 0; i < n_alloc; ++i) {
    PyObject* alloc = PyTuple_GET_ITEM(allocs, i);
    const Tensor& like = *operands[as_int(PyTuple_GET_ITEM(alloc, 0))];
    if (i == first && !first_shape.empty()) {
      fresh.push_back(at::empty(first_shape, like.options()));
      continue;
    }
    PyObject* shape = PyTuple_GET_ITEM(alloc, 1);
    std::array<int64_t, 4> dims{};
    const Py_ssize_t n_dims = PyTuple_GET_SIZE(shape);
    TORCH_CHECK(n_dims <= 4, "parallel_lora replay: an output of more than 4 dims");
    for (Py_ssize_t d = 0; d < n_dims; ++d) {
      dims[d] = as_int(PyTuple_GET_ITEM(shape, d));
    }
    fresh.push_back(at::empty(at::IntArrayRef(dims.data(), n_dims), like.options()));
  }
  std::vector<const Tensor*> ops;
  for (const Tensor* t : operands) {
    if (t != nullptr && t->defined()) {
      ops.push_back(t);
    }
  }
  const Py_ssize_t n_const = PyTuple_GET_SIZE(consts);
  const Py_ssize_t n_pool = n_const + ops.size() + fresh.size() + (seed == Py_None ? 0 : 1);
  const Ref owned(check(PyTuple_New(n_pool)));
  PyObject* pool = owned.p;
  Py_ssize_t at = 0;
  for (; at < n_const; ++at) {
    PyObject* c = PyTuple_GET_ITEM(consts, at);
    Py_INCREF(c);
    PyTuple_SET_ITEM(pool, at, c);
  }
  auto put_address = [&](const Tensor& t) {
    PyTuple_SET_ITEM(pool, at++, check(PyLong_FromVoidPtr(t.data_ptr())));
  };
  for (const Tensor* t : ops) {
    put_address(*t);
  }
  for (const Tensor& t : fresh) {
    put_address(t);
  }
  if (seed != Py_None) {
    if (THPVariable_Check(seed)) {
      put_address(THPVariable_Unpack(seed));
    } else {
      Py_INCREF(seed);
      PyTuple_SET_ITEM(pool, at++, seed);
    }
  }
  const Py_ssize_t n_launch = PyTuple_GET_SIZE(launches);
  for (Py_ssize_t i = 0; i < n_launch; ++i) {
    PyObject* launch = PyTuple_GET_ITEM(launches, i);
    const Ref args(check(PyObject_CallOneArg(PyTuple_GET_ITEM(launch, 1), pool)));
    Py_DECREF(check(PyObject_Call(PyTuple_GET_ITEM(launch, 0), args.p, nullptr)));
  }
  std::vector<Tensor> out(n_out);
  for (Py_ssize_t i = 0; i < n_out; ++i) {
    PyObject* slot = PyTuple_GET_ITEM(outputs, i);
    if (slot != Py_None) {
      out[i] = fresh[as_int(slot)];
    }
  }
  return out;
}

bool seed_fits(PyObject* program, PyObject* seed) {
  return reinterpret_cast<PyObject*>(Py_TYPE(seed)) == PyTuple_GET_ITEM(program, 0);
}

Tensor rows(const Tensor& t) {
  return t.dim() == 2 ? t : t.reshape({-1, t.size(-1)});
}

Tensor unpack_optional(PyObject* o) {
  return o == Py_None ? Tensor() : THPVariable_Unpack(o);
}

// A plan's replay state (functional.Plan.replay): (fwd by_stream, bwd_entries, LoRAFunction's apply, Plan.backward,
// the plan).
struct LoRABackward : public Node {
  SavedVariable x_, weight_, lora_A_, lora_B_, s_lora_;
  Ref state_, seed_;

  std::string name() const override {
    return "LoRABackward";
  }

  void release_variables() override {
    x_.reset_data();
    weight_.reset_data();
    lora_A_.reset_data();
    lora_B_.reset_data();
    s_lora_.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    const Tensor& dy = grads[0];
    variable_list out(5);
    if (!dy.defined()) {
      return out;
    }
    const Tensor x = x_.unpack(), weight = weight_.unpack(), lora_A = lora_A_.unpack(), lora_B = lora_B_.unpack();
    const Tensor s_lora = s_lora_.unpack();
    const bool needs[3] = {should_compute_output(0), should_compute_output(3), should_compute_output(4)};
    const Tensor dy2d = rows(dy), x2d = rows(x);
    Gil gil;
    PyObject* state = state_.p;
    PyObject* seed = seed_.p;
    PyObject* program = nullptr;
    {  // plan.bwd_entries[(dy.stride(), dy.data_ptr() & 15, needs)][1].by_stream[stream]
      PyObject* strides = check(PyTuple_New(dy2d.dim()));
      for (int64_t d = 0; d < dy2d.dim(); ++d) {
        PyTuple_SET_ITEM(strides, d, PyLong_FromLongLong(dy2d.stride(d)));
      }
      PyObject* wanted = PyTuple_Pack(3, needs[0] ? Py_True : Py_False, needs[1] ? Py_True : Py_False,
                                      needs[2] ? Py_True : Py_False);
      PyObject* align = PyLong_FromLongLong(reinterpret_cast<uintptr_t>(dy2d.data_ptr()) & 15);
      PyObject* key = PyTuple_Pack(3, strides, align, wanted);
      Py_DECREF(strides);
      Py_XDECREF(wanted);
      Py_XDECREF(align);
      check(key);
      PyObject* kept = PyDict_GetItemWithError(PyTuple_GET_ITEM(state, 1), key);
      Py_DECREF(key);
      if (kept == nullptr && PyErr_Occurred()) {
        raise_python();
      }
      if (kept != nullptr) {
        PyObject* by_stream = check(PyObject_GetAttrString(PyTuple_GET_ITEM(kept, 1), "by_stream"));
        program = stream_program(by_stream, dy2d);
        Py_DECREF(by_stream);
      }
    }
    Tensor dx, dA, dB;
    if (program != nullptr && seed_fits(program, seed)) {
      const auto g = run_program(program, {&dy2d, &x2d, &weight, &lora_A, &lora_B, &s_lora}, seed,
                                 needs[0] && x.dim() != 2 ? x.sizes() : at::IntArrayRef());
      dx = g[0], dA = g[1], dB = g[2];
    } else {  // not recorded yet: plan.backward records it
      PyObject* result = check(PyObject_CallFunction(
          PyTuple_GET_ITEM(state, 3), "ONNNNNNO(OOO)", PyTuple_GET_ITEM(state, 4), THPVariable_Wrap(dy2d), THPVariable_Wrap(x2d),
          THPVariable_Wrap(weight), THPVariable_Wrap(lora_A), THPVariable_Wrap(lora_B), THPVariable_Wrap(s_lora),
          seed, needs[0] ? Py_True : Py_False, needs[1] ? Py_True : Py_False, needs[2] ? Py_True : Py_False));
      dx = unpack_optional(PyTuple_GET_ITEM(result, 0));
      dA = unpack_optional(PyTuple_GET_ITEM(result, 1));
      dB = unpack_optional(PyTuple_GET_ITEM(result, 2));
      Py_DECREF(result);
      if (dx.defined() && x.dim() != 2) {
        dx = dx.reshape(x.sizes());
      }
    }
    out[0] = dx, out[3] = dA, out[4] = dB;
    return out;
  }
};

// A new node as the autograd graph holds it: std::shared_ptr through torch 2.11, c10::intrusive_ptr after.
template <typename Ptr = decltype(torch::autograd::Edge::function)>
auto make_node() {
  if constexpr (std::is_same_v<Ptr, std::shared_ptr<Node>>) {
    return std::shared_ptr<LoRABackward>(new LoRABackward());
  } else {
    return c10::make_intrusive<LoRABackward>();
  }
}

bool plain(PyObject* o) {
  return o == Py_None || THPVariable_CheckExact(o) || Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(parameter_type);
}

// LoRAFunction's apply(x, weight, bias, lora_A, lora_B, plan, seed).
PyObject* fallback(PyObject* state, PyObject* const* args) {
  PyObject* call[7] = {args[1], args[2], args[3], args[4], args[5], PyTuple_GET_ITEM(state, 4), args[6]};
  return PyObject_Vectorcall(PyTuple_GET_ITEM(state, 2), call, 7, nullptr);
}

// replay(state, x, weight, bias, lora_A, lora_B, seed) -> y: the layer's call through its recorded programs, or
// through ``state[2]`` (LoRAFunction) where no program fits it.
PyObject* replay(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs == 7, "replay(state, x, weight, bias, lora_A, lora_B, seed)");
  PyObject* state = args[0];
  PyObject* seed = args[6];
  for (int i = 1; i < 6; ++i) {
    if (!plain(args[i])) {  // a tensor subclass: its __torch_function__ runs through LoRAFunction
      return fallback(state, args);
    }
  }
  const Tensor& x = THPVariable_Unpack(args[1]);
  const Tensor& weight = THPVariable_Unpack(args[2]);
  const Tensor bias = unpack_optional(args[3]);
  const Tensor& lora_A = THPVariable_Unpack(args[4]);
  const Tensor& lora_B = THPVariable_Unpack(args[5]);
  PyObject* program = stream_program(PyTuple_GET_ITEM(state, 0), x);
  const bool frozen = !weight.requires_grad() && !(bias.defined() && bias.requires_grad());
  const bool dual = torch::autograd::isFwGradDefined(x) || torch::autograd::isFwGradDefined(lora_A) ||
                    torch::autograd::isFwGradDefined(lora_B) || torch::autograd::isFwGradDefined(weight);
  if (program == nullptr || !seed_fits(program, seed) || !frozen || dual) {
    return fallback(state, args);
  }
  const Tensor x2d = rows(x);
  std::vector<int64_t> y_shape;
  if (x.dim() != 2) {
    y_shape = x.sizes().vec();
    y_shape.back() = weight.size(0);
  }
  const auto outs = run_program(program, {&x2d, &weight, &bias, &lora_A, &lora_B, nullptr}, seed, y_shape);
  const Tensor& y = outs[0];
  if (torch::autograd::compute_requires_grad(x, lora_A, lora_B)) {
    auto node = make_node();
    node->set_next_edges(torch::autograd::collect_next_edges(x, weight, bias, lora_A, lora_B));
    node->x_ = SavedVariable(x, false);
    node->weight_ = SavedVariable(weight, false);
    node->lora_A_ = SavedVariable(lora_A, false);
    node->lora_B_ = SavedVariable(lora_B, false);
    node->s_lora_ = SavedVariable(outs[1], false);
    Py_INCREF(state);
    node->state_.p = state;
    Py_INCREF(seed);
    node->seed_.p = seed;
    torch::autograd::set_history(y, node);
  }
  return THPVariable_Wrap(y);
  END_HANDLE_TH_ERRORS
}


// ---- parallel_lora::lora_forward / lora_backward (the compiled graph's calls): their recorded programs by call ----

PyObject* ops_module = nullptr;  // parallel_lora.kernels.ops: _forward, _backward, _programs

using Key = std::vector<int64_t>;

struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = k.size();
    for (int64_t v : k) {
      h ^= std::hash<int64_t>{}(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    }
    return h;
  }
};

std::unordered_map<Key, PyObject*, KeyHash> op_programs;  // a call's layouts and scalars -> its Programs; the GIL's
constexpr size_t OP_PROGRAMS_KEPT = 1024;

void forget_op_programs() {
  for (auto& kept : op_programs) {
    Py_DECREF(kept.second);
  }
  op_programs.clear();
}

void key_tensor(Key& k, const Tensor& t) {
  if (!t.defined()) {
    k.push_back(-1);
    return;
  }
  k.push_back(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) {
    k.push_back(t.size(d));
    k.push_back(t.stride(d));
  }
  k.push_back(static_cast<int64_t>(t.scalar_type()));
  k.push_back(static_cast<int64_t>(t.device().type()));
  k.push_back(t.device().index());
  k.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) & 15));
}

void key_double(Key& k, double v) {
  int64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  k.push_back(bits);
}

// The scalars every call of the op passes: scale, p, seed, position, k_offset.
struct Scalars {
  double scale, p;
  const std::optional<Tensor>& seed;
  std::string_view position;
  int64_t k_offset;

  void key(Key& k) const {
    key_double(k, scale);
    key_double(k, p);
    key_tensor(k, seed.has_value() ? *seed : Tensor());
    for (char c : position) {
      k.push_back(c);
    }
    k.push_back(k_offset);
  }

  void to_python(PyObject* args, Py_ssize_t at) const {  // steals nothing: fills args[at:at + 5]
    PyTuple_SET_ITEM(args, at, PyFloat_FromDouble(scale));
    PyTuple_SET_ITEM(args, at + 1, PyFloat_FromDouble(p));
    PyTuple_SET_ITEM(args, at + 2, seed.has_value() && seed->defined() ? THPVariable_Wrap(*seed) : Py_NewRef(Py_None));
    PyTuple_SET_ITEM(args, at + 3, PyUnicode_FromStringAndSize(position.data(), position.size()));
    PyTuple_SET_ITEM(args, at + 4, PyLong_FromLongLong(k_offset));
  }

  PyObject* seed_object() const {  // as dispatch passes it to Programs.run: None without a mask
    return p == 0.0 || !seed.has_value() || !seed->defined() ? Py_NewRef(Py_None) : THPVariable_Wrap(*seed);
  }
};

bool any_grad(std::initializer_list<const Tensor*> tensors) {
  if (!at::GradMode::is_enabled()) {
    return false;
  }
  for (const Tensor* t : tensors) {
    if (t->defined() && t->requires_grad()) {
      return true;
    }
  }
  return false;
}

// ops.<name>(*args) for a call no program fits; ops._programs(direction, *args) -> Programs or None once per key.
PyObject* op_python(const char* name, PyObject* args, Key* key, const char* direction) {
  PyObject* fn = check(PyObject_GetAttrString(ops_module, name));
  PyObject* result = PyObject_Call(fn, args, nullptr);
  Py_DECREF(fn);
  if (result == nullptr || key == nullptr) {
    Py_DECREF(args);
    return check(result);
  }
  PyObject* programs = PyObject_CallMethod(ops_module, "_programs", "sO", direction, args);
  Py_DECREF(args);
  if (programs == nullptr) {
    Py_DECREF(result);
    raise_python();
  }
  if (programs == Py_None) {
    Py_DECREF(programs);
  } else {
    if (op_programs.size() >= OP_PROGRAMS_KEPT) {
      forget_op_programs();
    }
    op_programs.emplace(std::move(*key), programs);
  }
  return result;
}

// The kept Programs' program for this stream and seed, if any (borrowed).
PyObject* op_program(const Key& key, const Tensor& first, PyObject* seed) {
  auto found = op_programs.find(key);
  if (found == op_programs.end()) {
    return nullptr;
  }
  PyObject* by_stream = check(PyObject_GetAttrString(found->second, "by_stream"));
  PyObject* program = stream_program(by_stream, first);
  Py_DECREF(by_stream);
  return program != nullptr && seed_fits(program, seed) ? program : nullptr;
}

// The call's outputs from the kept program that fits it (``operands[0]``'s stream, the seed's kind), else nullopt.
std::optional<std::vector<Tensor>> op_replay(const Key& key, const std::array<const Tensor*, 6>& operands,
                                             const Scalars& scalars) {
  const Ref seed(scalars.seed_object());
  PyObject* program = op_program(key, *operands[0], seed.p);
  if (program == nullptr) {
    return std::nullopt;
  }
  return run_program(program, operands, seed.p, {});
}

Key op_key(std::initializer_list<const Tensor*> tensors, const Scalars& scalars) {
  Key key;
  key.reserve(64);
  for (const Tensor* t : tensors) {
    key_tensor(key, *t);
  }
  scalars.key(key);
  const Tensor& first = **tensors.begin();
  // a kernel is loaded and launched on the current device (dispatch._device_key)
  key.push_back(first.is_cuda() ? c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index() : -1);
  return key;
}

std::tuple<Tensor, Tensor> op_forward(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias_,
                                      const Tensor& lora_A, const Tensor& lora_B, double scale, double p,
                                      const std::optional<Tensor>& seed, c10::string_view position,
                                      int64_t k_offset) {
  const Tensor bias = bias_.has_value() ? *bias_ : Tensor();
  const Scalars scalars{scale, p, seed, std::string_view(position.data(), position.size()), k_offset};
  Gil gil;
  const bool grad = any_grad({&x, &weight, &bias, &lora_A, &lora_B});  // ops._forward refuses it
  Key key = grad ? Key() : op_key({&x, &weight, &bias, &lora_A, &lora_B}, scalars);
  if (!grad) {
    if (auto outs = op_replay(key, {&x, &weight, &bias, &lora_A, &lora_B, nullptr}, scalars)) {
      return {(*outs)[0], (*outs)[1]};
    }
  }
  PyObject* args = check(PyTuple_New(10));
  PyTuple_SET_ITEM(args, 0, THPVariable_Wrap(x));
  PyTuple_SET_ITEM(args, 1, THPVariable_Wrap(weight));
  PyTuple_SET_ITEM(args, 2, bias.defined() ? THPVariable_Wrap(bias) : Py_NewRef(Py_None));
  PyTuple_SET_ITEM(args, 3, THPVariable_Wrap(lora_A));
  PyTuple_SET_ITEM(args, 4, THPVariable_Wrap(lora_B));
  scalars.to_python(args, 5);
  const bool known = grad || op_programs.count(key) > 0;
  PyObject* result = op_python("_forward", args, known ? nullptr : &key, "forward");
  std::tuple<Tensor, Tensor> out{THPVariable_Unpack(PyTuple_GET_ITEM(result, 0)),
                                 THPVariable_Unpack(PyTuple_GET_ITEM(result, 1))};
  Py_DECREF(result);
  return out;
}

std::tuple<Tensor, Tensor, Tensor> op_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                               const Tensor& lora_A, const Tensor& lora_B, const Tensor& s_lora,
                                               double scale, double p, const std::optional<Tensor>& seed,
                                               c10::string_view position, int64_t k_offset, bool needs_dx,
                                               bool needs_dA, bool needs_dB) {
  const Scalars scalars{scale, p, seed, std::string_view(position.data(), position.size()), k_offset};
  Gil gil;
  const bool grad = any_grad({&dy, &x, &weight, &lora_A, &lora_B, &s_lora});
  Key key = grad ? Key() : op_key({&dy, &x, &weight, &lora_A, &lora_B, &s_lora}, scalars);
  key.insert(key.end(), {needs_dx, needs_dA, needs_dB});
  if (!grad) {
    if (auto g = op_replay(key, {&dy, &x, &weight, &lora_A, &lora_B, &s_lora}, scalars)) {
      for (Tensor& t : *g) {
        if (!t.defined()) {
          t = at::empty({0}, dy.options());  // ops._backward: a gradient not asked for comes back empty
        }
      }
      return {(*g)[0], (*g)[1], (*g)[2]};
    }
  }
  PyObject* args = check(PyTuple_New(14));
  const Tensor* tensors[6] = {&dy, &x, &weight, &lora_A, &lora_B, &s_lora};
  for (int i = 0; i < 6; ++i) {
    PyTuple_SET_ITEM(args, i, THPVariable_Wrap(*tensors[i]));
  }
  scalars.to_python(args, 6);
  PyTuple_SET_ITEM(args, 11, PyBool_FromLong(needs_dx));
  PyTuple_SET_ITEM(args, 12, PyBool_FromLong(needs_dA));
  PyTuple_SET_ITEM(args, 13, PyBool_FromLong(needs_dB));
  const bool known = grad || op_programs.count(key) > 0;
  PyObject* result = op_python("_backward", args, known ? nullptr : &key, "backward");
  std::tuple<Tensor, Tensor, Tensor> out{THPVariable_Unpack(PyTuple_GET_ITEM(result, 0)),
                                         THPVariable_Unpack(PyTuple_GET_ITEM(result, 1)),
                                         THPVariable_Unpack(PyTuple_GET_ITEM(result, 2))};
  Py_DECREF(result);
  return out;
}

void register_ops() {
  for (auto key : {c10::DispatchKey::CUDA, c10::DispatchKey::CPU}) {
    auto* lib = new torch::Library(torch::Library::IMPL, "parallel_lora", key, __FILE__, __LINE__);  // kept
    lib->impl("lora_forward", TORCH_FN(op_forward));
    lib->impl("lora_backward", TORCH_FN(op_backward));
  }
}

PyObject* forget(PyObject* /*module*/, PyObject* /*unused*/) {
  forget_op_programs();
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"replay", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(replay)), METH_FASTCALL,
     "replay(state, x, weight, bias, lora_A, lora_B, seed) -> y"},
    {"forget", forget, METH_NOARGS, "forget() -> None: drop the ops' kept programs (dispatch.clear_sites)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "parallel_lora_replay", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_parallel_lora_replay() {
  PyObject* torch_c = PyImport_ImportModule("torch._C");
  PyObject* nn = PyImport_ImportModule("torch.nn");
  if (torch_c == nullptr || nn == nullptr) {
    return nullptr;
  }
  raw_stream = PyObject_GetAttrString(torch_c, "_cuda_getCurrentRawStream");
  if (raw_stream == nullptr) {
    PyErr_Clear();
  }
  parameter_type = PyObject_GetAttrString(nn, "Parameter");
  Py_DECREF(torch_c);
  Py_DECREF(nn);
  ops_module = PyImport_ImportModule("parallel_lora.kernels.ops");
  if (parameter_type == nullptr || ops_module == nullptr) {
    return nullptr;
  }
  PyObject* module = PyModule_Create(&module_def);
  if (module != nullptr) {
    try {
      register_ops();
    } catch (const std::exception& e) {
      Py_DECREF(module);
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return nullptr;
    }
  }
  return module;
}

// ext_proc's native gRPC front (docs/design.md, "ext_proc's gRPC fronts").
//
// gRPC C++'s async generic server runs HTTP/2 on one thread of its own, which never touches Python. It
// queues what happens on each stream (opened, a message, half-closed, closed) and wakes the asyncio loop
// through an eventfd only when the queue was empty, so under load one wake-up carries many events. The
// loop answers with write() and finish(), which start the operations from its thread. grpcio's aio server,
// by contrast, hands every completion from its poller thread to the loop and runs Cython per operation:
// measured, about half of ext_proc's CPU per decision (docs/benchmarks.md, section 3).
//
// Locks: calls_mu guards the id -> call map and is taken before a call's own mu; events_mu guards the
// queue and is never held with another lock. The completion-queue thread never waits for the GIL, and
// Python never holds a lock while it waits for anything, so the two cannot deadlock.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

enum Op { OP_NEW, OP_READ, OP_WRITE, OP_FINISH, OP_DONE };
enum Kind { OPENED = 0, MESSAGE = 1, HALF_CLOSED = 2, CLOSED = 3 };

using Metadata = std::vector<std::pair<std::string, std::string>>;

struct Event {
  uint64_t id;
  int kind;
  std::string data;  // OPENED: the method; MESSAGE: the message; CLOSED: "cancelled" or ""
  Metadata metadata;  // OPENED, when asked for
};

struct Call;
struct Tag {
  Call* call;
  Op op;
};

// One stream. Freed by the completion-queue thread once no operation is outstanding and the "done"
// notification has come (which also takes it out of the map, so Python can no longer reach it).
struct Call {
  uint64_t id = 0;
  grpc::GenericServerContext ctx;
  grpc::GenericServerAsyncReaderWriter stream{&ctx};
  grpc::ByteBuffer in;
  std::deque<grpc::ByteBuffer> out;
  Tag t_new{this, OP_NEW}, t_read{this, OP_READ}, t_write{this, OP_WRITE}, t_finish{this, OP_FINISH},
      t_done{this, OP_DONE};
  std::mutex mu;
  int pending = 2;  // the call request and the done notification
  bool writing = false, finish_asked = false, finishing = false, done = false;
  grpc::Status status;
};

std::string flatten(grpc::ByteBuffer& buffer) {
  std::string data;
  grpc::Slice slice;
  if (buffer.TrySingleSlice(&slice).ok()) {
    data.assign(reinterpret_cast<const char*>(slice.begin()), slice.size());
  } else {
    std::vector<grpc::Slice> slices;
    if (buffer.Dump(&slices).ok())
      for (auto& s : slices) data.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  buffer.Clear();
  return data;
}

class Front {
 public:
  grpc::AsyncGenericService service;  // declared first: destroyed after the server that uses it
  std::unique_ptr<grpc::ServerCompletionQueue> cq;
  std::unique_ptr<grpc::Server> server;
  std::thread thread;
  int wake_fd = -1;
  bool with_metadata = false;
  std::atomic<bool> stopping{false};
  bool joined = false;

  std::mutex calls_mu;
  std::unordered_map<uint64_t, Call*> calls;
  uint64_t next_id = 1;

  std::mutex events_mu;
  std::vector<Event> events;

  void push(Event&& event) {
    bool wake;
    {
      std::lock_guard<std::mutex> g(events_mu);
      wake = events.empty();
      events.push_back(std::move(event));
    }
    if (wake) {
      uint64_t one = 1;
      ssize_t ignored = write(wake_fd, &one, sizeof one);
      (void)ignored;
    }
  }

  void request_call() {
    Call* c = new Call();
    c->ctx.AsyncNotifyWhenDone(&c->t_done);
    service.RequestCall(&c->ctx, &c->stream, cq.get(), cq.get(), &c->t_new);
  }

  // With c->mu held: the next queued write, or the finish once every write is out.
  void advance(Call* c) {
    if (c->writing || c->finishing || c->done) return;
    if (!c->out.empty()) {
      c->writing = true;
      c->pending++;
      c->stream.Write(c->out.front(), &c->t_write);
    } else if (c->finish_asked) {
      c->finishing = true;
      c->pending++;
      c->stream.Finish(c->status, &c->t_finish);
    }
  }

  // With c->mu held: one operation has completed; true when the call can be freed.
  static bool settle(Call* c) { return --c->pending == 0 && c->done; }

  void opened(Call* c) {
    if (!stopping) request_call();
    {
      std::lock_guard<std::mutex> g(calls_mu);
      c->id = next_id++;
      calls[c->id] = c;
    }
    Event event{c->id, OPENED, c->ctx.method(), {}};
    if (with_metadata)
      for (auto& [key, value] : c->ctx.client_metadata())
        event.metadata.emplace_back(std::string(key.data(), key.size()), std::string(value.data(), value.size()));
    push(std::move(event));
    std::lock_guard<std::mutex> g(c->mu);
    c->pending++;  // the request's completion is settled below; the read starts now
    c->stream.Read(&c->in, &c->t_read);
  }

  void run() {
    pthread_setname_np(pthread_self(), "ext_proc-front");
    void* tag;
    bool ok;
    while (cq->Next(&tag, &ok)) {
      Tag* t = static_cast<Tag*>(tag);
      Call* c = t->call;
      bool free_it;
      switch (t->op) {
        case OP_NEW:
          if (ok) opened(c);
          break;
        case OP_READ:
          if (ok) {
            push(Event{c->id, MESSAGE, flatten(c->in), {}});
            std::lock_guard<std::mutex> g(c->mu);
            if (!c->finishing && !c->done) {
              c->stream.Read(&c->in, &c->t_read);  // read ahead: at most one read is outstanding
              continue;
            }
          } else {
            push(Event{c->id, HALF_CLOSED, std::string(), {}});
          }
          break;
        case OP_WRITE: {
          std::lock_guard<std::mutex> g(c->mu);
          c->writing = false;
          if (!c->out.empty()) c->out.pop_front();
          if (!ok) c->out.clear();  // the stream is gone: the rest cannot be sent
          advance(c);
          break;
        }
        case OP_FINISH:
          break;
        case OP_DONE: {
          if (c->id) {
            {
              std::lock_guard<std::mutex> g(calls_mu);
              calls.erase(c->id);
            }
            push(Event{c->id, CLOSED, c->ctx.IsCancelled() ? "cancelled" : "", {}});
          }
          std::lock_guard<std::mutex> g(c->mu);
          c->done = true;
          break;
        }
      }
      {
        std::lock_guard<std::mutex> g(c->mu);
        free_it = settle(c);
        if (t->op == OP_NEW && !ok) free_it = c->pending == 1;  // never started: no done notification comes
      }
      if (free_it) delete c;
    }
  }

  // Python's side (GIL held): act on a call that is still open; false when it is gone.
  template <typename F>
  bool with_call(uint64_t id, F act) {
    std::lock_guard<std::mutex> g(calls_mu);  // held throughout: the call cannot be freed meanwhile
    auto it = calls.find(id);
    if (it == calls.end()) return false;
    Call* c = it->second;
    std::lock_guard<std::mutex> g2(c->mu);
    if (c->done || c->finish_asked) return false;
    act(c);
    advance(c);
    return true;
  }

  void shut_down(std::chrono::system_clock::time_point deadline) {
    stopping = true;
    server->Shutdown(deadline);
    cq->Shutdown();
    if (thread.joinable()) thread.join();
    joined = true;
  }
};

struct PyFront {
  PyObject_HEAD Front* front;
};

int parse_address_list(PyObject* addresses, std::vector<std::string>* out) {
  PyObject* seq = PySequence_Fast(addresses, "addresses: a sequence of str");
  if (!seq) return -1;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
    const char* a = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i));
    if (!a) {
      Py_DECREF(seq);
      return -1;
    }
    out->emplace_back(a);
  }
  Py_DECREF(seq);
  return 0;
}

PyObject* front_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
  static const char* names[] = {"addresses", "max_message_bytes", "reuse_port", "with_metadata", nullptr};
  PyObject* addresses;
  int max_bytes = 4 << 20, reuse_port = 0, with_metadata = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|ipp", const_cast<char**>(names), &addresses, &max_bytes,
                                   &reuse_port, &with_metadata))
    return nullptr;
  std::vector<std::string> targets;
  if (parse_address_list(addresses, &targets) < 0) return nullptr;
  auto front = std::make_unique<Front>();
  front->with_metadata = with_metadata;
  front->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (front->wake_fd < 0) return PyErr_SetFromErrno(PyExc_OSError);
  grpc::ServerBuilder builder;
  std::vector<int> bound(targets.size(), 0);
  for (size_t i = 0; i < targets.size(); i++)
    builder.AddListeningPort(targets[i], grpc::InsecureServerCredentials(), &bound[i]);
  builder.RegisterAsyncGenericService(&front->service);
  builder.SetMaxReceiveMessageSize(max_bytes);
  builder.SetMaxSendMessageSize(max_bytes);
  // As ext_proc's grpcio server (serving.server_options): Envoy pings an idle connection.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, reuse_port ? 1 : 0);
  front->cq = builder.AddCompletionQueue();
  Py_BEGIN_ALLOW_THREADS;
  front->server = builder.BuildAndStart();
  Py_END_ALLOW_THREADS;
  std::string unbound;
  for (size_t i = 0; i < targets.size(); i++)
    if (bound[i] == 0) unbound += (unbound.empty() ? "" : ", ") + targets[i];
  if (!front->server || !unbound.empty()) {
    if (front->server) front->server->Shutdown();
    front->cq->Shutdown();
    void* tag;
    bool ok;
    while (front->cq->Next(&tag, &ok)) {
    }
    close(front->wake_fd);
    PyErr_Format(PyExc_OSError, "cannot listen on %s", unbound.empty() ? "the given addresses" : unbound.c_str());
    return nullptr;
  }
  for (int i = 0; i < 16; i++) front->request_call();  // calls that can open before the thread comes round
  Front* f = front.get();
  front->thread = std::thread([f] { f->run(); });
  PyFront* self = reinterpret_cast<PyFront*>(type->tp_alloc(type, 0));
  if (!self) {
    front->shut_down(std::chrono::system_clock::now());
    close(front->wake_fd);
    return nullptr;
  }
  self->front = front.release();
  return reinterpret_cast<PyObject*>(self);
}

PyObject* front_fileno(PyFront* self, PyObject*) { return PyLong_FromLong(self->front->wake_fd); }

PyObject* event_tuple(Event& e) {
  if (e.kind == OPENED) {
    PyObject* metadata = Py_None;
    Py_INCREF(Py_None);
    if (!e.metadata.empty()) {
      Py_DECREF(Py_None);
      metadata = PyList_New(static_cast<Py_ssize_t>(e.metadata.size()));
      if (!metadata) return nullptr;
      for (size_t i = 0; i < e.metadata.size(); i++) {
        auto& [k, v] = e.metadata[i];
        PyObject* pair = Py_BuildValue("(s#y#)", k.data(), (Py_ssize_t)k.size(), v.data(), (Py_ssize_t)v.size());
        if (!pair) {
          Py_DECREF(metadata);
          return nullptr;
        }
        PyList_SET_ITEM(metadata, i, pair);
      }
    }
    return Py_BuildValue("(KiNs#)", (unsigned long long)e.id, e.kind, metadata, e.data.data(),
                         (Py_ssize_t)e.data.size());
  }
  return Py_BuildValue("(Kiy#)", (unsigned long long)e.id, e.kind, e.data.data(), (Py_ssize_t)e.data.size());
}

PyObject* front_drain(PyFront* self, PyObject*) {
  Front* f = self->front;
  uint64_t count;
  ssize_t ignored = read(f->wake_fd, &count, sizeof count);  // re-arm before taking the queue
  (void)ignored;
  std::vector<Event> got;
  {
    std::lock_guard<std::mutex> g(f->events_mu);
    got.swap(f->events);
  }
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(got.size()));
  if (!list) return nullptr;
  for (size_t i = 0; i < got.size(); i++) {
    PyObject* item = event_tuple(got[i]);
    if (!item) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, i, item);
  }
  return list;
}

PyObject* front_write(PyFront* self, PyObject* args) {
  unsigned long long id;
  Py_buffer message;
  int finish = 0;
  if (!PyArg_ParseTuple(args, "Ky*|p", &id, &message, &finish)) return nullptr;
  grpc::Slice slice(message.buf, static_cast<size_t>(message.len));
  PyBuffer_Release(&message);
  bool queued = self->front->with_call(id, [&](Call* c) {
    c->out.emplace_back(&slice, 1);
    if (finish) {
      c->finish_asked = true;
      c->status = grpc::Status::OK;
    }
  });
  return PyBool_FromLong(queued);
}

PyObject* front_finish(PyFront* self, PyObject* args) {
  unsigned long long id;
  int code = 0;
  const char* details = "";
  if (!PyArg_ParseTuple(args, "K|is", &id, &code, &details)) return nullptr;
  if (code < 0 || code > 16) {
    PyErr_Format(PyExc_ValueError, "not a gRPC status code: %d", code);
    return nullptr;
  }
  bool queued = self->front->with_call(id, [&](Call* c) {
    c->finish_asked = true;
    c->status = grpc::Status(static_cast<grpc::StatusCode>(code), details);
  });
  return PyBool_FromLong(queued);
}

PyObject* front_stop(PyFront* self, PyObject* args) {
  double grace = 0;
  if (!PyArg_ParseTuple(args, "|d", &grace)) return nullptr;
  Front* f = self->front;
  if (f->stopping.exchange(true)) Py_RETURN_NONE;
  auto deadline = std::chrono::system_clock::now() + std::chrono::microseconds(static_cast<long>(grace * 1e6));
  Py_BEGIN_ALLOW_THREADS;
  f->shut_down(deadline);
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

void front_dealloc(PyFront* self) {
  Front* f = self->front;
  if (f) {
    if (!f->joined) {
      Py_BEGIN_ALLOW_THREADS;
      f->shut_down(std::chrono::system_clock::now());
      Py_END_ALLOW_THREADS;
    }
    if (f->wake_fd >= 0) close(f->wake_fd);
    delete f;
  }
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyMethodDef front_methods[] = {
    {"fileno", (PyCFunction)front_fileno, METH_NOARGS, "fileno() -> the eventfd, readable while events wait."},
    {"drain", (PyCFunction)front_drain, METH_NOARGS,
     "drain() -> [(id, kind, data)], or (id, OPENED, metadata, method) for a new stream."},
    {"write", (PyCFunction)front_write, METH_VARARGS,
     "write(id, message, finish=False) -> False when the stream is gone or finishing."},
    {"finish", (PyCFunction)front_finish, METH_VARARGS,
     "finish(id, code=0, details='') -> False when the stream is gone or finishing."},
    {"stop", (PyCFunction)front_stop, METH_VARARGS,
     "stop(grace_s=0): refuse new streams, wait up to grace_s for open ones, cancel the rest; blocks."},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject FrontType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_native_front",
                          "ext_proc's native gRPC front: gRPC C++ streams handed to asyncio in batches.", -1,
                          nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__native_front(void) {
  FrontType.tp_name = "ext_proc._native_front.Front";
  FrontType.tp_doc = "Front(addresses, max_message_bytes=4 MiB, reuse_port=False, with_metadata=False)";
  FrontType.tp_basicsize = sizeof(PyFront);
  FrontType.tp_flags = Py_TPFLAGS_DEFAULT;
  FrontType.tp_new = front_new;
  FrontType.tp_dealloc = (destructor)front_dealloc;
  FrontType.tp_methods = front_methods;
  if (PyType_Ready(&FrontType) < 0) return nullptr;
  PyObject* m = PyModule_Create(&module_def);
  if (!m) return nullptr;
  Py_INCREF(&FrontType);
  if (PyModule_AddObject(m, "Front", reinterpret_cast<PyObject*>(&FrontType)) < 0 ||
      PyModule_AddIntConstant(m, "OPENED", OPENED) < 0 || PyModule_AddIntConstant(m, "MESSAGE", MESSAGE) < 0 ||
      PyModule_AddIntConstant(m, "HALF_CLOSED", HALF_CLOSED) < 0 ||
      PyModule_AddIntConstant(m, "CLOSED", CLOSED) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}

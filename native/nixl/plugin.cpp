// NIXL backend plugin: NIXL's transfers, registrations and notifications over the
// mooncake_plugins transfer engine.
//
// A thin C++ class on NIXL's vtable (nixl_abi.h) that forwards every call to one Python
// object, mooncake_plugins.nixl.backend.NixlBackend, holding the GIL only for that call.
// The bytes move in the engine, which releases the GIL around its copies and socket I/O.
// It runs in a Python process (vLLM, SGLang, Dynamo, or a script using NIXL's Python API):
// the Python C API symbols are resolved from the process that loads it.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "nixl_abi.h"

using namespace mcnixl;

namespace {

const char *const PLUGIN_NAME = "MOONCAKE";
const char *const PLUGIN_VERSION = "0.1.0";

// Whether the interpreter is shutting down (or gone): Python must not be called then.
bool python_gone() {
#if PY_VERSION_HEX >= 0x030D0000
    return !Py_IsInitialized() || Py_IsFinalizing();
#else
    return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

class Gil {  // the GIL for one call into Python, from any thread
    PyGILState_STATE state_;

  public:
    Gil() : state_(PyGILState_Ensure()) {}
    ~Gil() { PyGILState_Release(state_); }
    Gil(const Gil &) = delete;
    Gil &operator=(const Gil &) = delete;
};

// Report and clear a Python exception raised by one of the backend's methods (they catch
// and log their own errors; this is for what escaped them).
Status python_failed(const char *what) {
    fprintf(stderr, "mooncake_plugins NIXL backend: %s raised:\n", what);
    PyErr_Print();
    return ERR_BACKEND;
}

// Call obj.method(*args) and take an int status from the result (nullptr on failure).
Status call_status(PyObject *obj, const char *method, PyObject *args) {
    if (args == nullptr) return python_failed(method);
    PyObject *fn = PyObject_GetAttrString(obj, method);
    PyObject *res = fn ? PyObject_CallObject(fn, args) : nullptr;
    Py_XDECREF(fn);
    Py_DECREF(args);
    if (res == nullptr) return python_failed(method);
    long v = PyLong_AsLong(res);
    Py_DECREF(res);
    if (v == -1 && PyErr_Occurred()) return python_failed(method);
    return static_cast<Status>(v);
}

PyObject *bytes_of(const std::string &s) {
    return PyBytes_FromStringAndSize(s.data(), static_cast<Py_ssize_t>(s.size()));
}

PyObject *str_of(const std::string &s) {
    return PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "surrogateescape");
}

class LocalMD : public BackendMD {  // one registration of ours: the backend's token
  public:
    long token;
    explicit LocalMD(long t) : BackendMD(true), token(t) {}
};

class RemoteMD : public BackendMD {  // a peer's (or our own) region: nothing to keep
  public:
    RemoteMD() : BackendMD(false) {}
};

// A request handle: the descriptors it was prepared with, and the backend's transfer.
class Request : public BackendReqH {
  public:
    std::vector<uint64_t> triples;  // local address, remote address, length per descriptor
    PyObject *xfer = nullptr;       // the backend's transfer object (a new reference)
    ~Request() override {
        if (xfer != nullptr && !python_gone()) {
            Gil gil;
            Py_DECREF(xfer);
        }
    }
};

Status pack(const MetaDescList &local, const MetaDescList &remote, std::vector<uint64_t> &out) {
    const size_t n = local.descs.size();
    if (n != remote.descs.size()) return ERR_INVALID_PARAM;
    out.resize(3 * n);
    for (size_t i = 0; i < n; ++i) {
        const MetaDesc &l = local.descs[i];
        const MetaDesc &r = remote.descs[i];
        if (l.len != r.len) return ERR_INVALID_PARAM;
        out[3 * i] = l.addr;
        out[3 * i + 1] = r.addr;
        out[3 * i + 2] = l.len;
    }
    return SUCCESS;
}

class Engine : public BackendEngine {
    PyObject *py_ = nullptr;  // mooncake_plugins.nixl.backend.NixlBackend

  public:
    explicit Engine(const InitParams *p) : BackendEngine(p) {
        if (!Py_IsInitialized()) {
            fprintf(stderr, "mooncake_plugins NIXL backend: needs a Python process (the "
                            "engine is Python); this process has no interpreter\n");
            initErr = true;
            return;
        }
        Gil gil;
        PyObject *mod = PyImport_ImportModule("mooncake_plugins.nixl.backend");
        PyObject *cls = mod ? PyObject_GetAttrString(mod, "NixlBackend") : nullptr;
        PyObject *params = PyDict_New();
        for (const auto &kv : this->params()) {
            PyObject *k = str_of(kv.first), *v = str_of(kv.second);
            if (k && v) PyDict_SetItem(params, k, v);
            Py_XDECREF(k);
            Py_XDECREF(v);
        }
        PyObject *agent = str_of(localAgent);
        py_ = (cls && agent) ? PyObject_CallFunctionObjArgs(cls, agent, params, nullptr) : nullptr;
        Py_XDECREF(agent);
        Py_DECREF(params);
        Py_XDECREF(cls);
        Py_XDECREF(mod);
        if (py_ == nullptr) {
            python_failed("creating the backend");
            initErr = true;
        }
    }

    ~Engine() override {
        // At interpreter exit the backend was closed by its atexit hook (backend.py), and
        // Python can no longer be called: the object is left to the dying interpreter.
        if (py_ == nullptr || python_gone()) return;
        Gil gil;
        PyObject *res = PyObject_CallMethod(py_, "close", nullptr);
        if (res == nullptr) python_failed("close");
        Py_XDECREF(res);
        Py_CLEAR(py_);
    }

    bool supportsRemote() const override { return true; }
    bool supportsLocal() const override { return true; }
    bool supportsNotif() const override { return true; }
    MemList getSupportedMems() const override { return {DRAM_SEG, VRAM_SEG}; }

    Status registerMem(const BlobDesc &mem, const MemType &kind, BackendMD *&out) override {
        Gil gil;
        PyObject *res = PyObject_CallMethod(py_, "register", "KKKi",
                                            (unsigned long long)mem.addr,
                                            (unsigned long long)mem.len,
                                            (unsigned long long)mem.devId, (int)kind);
        if (res == nullptr) return python_failed("register");
        long token = PyLong_AsLong(res);
        Py_DECREF(res);
        if (token == -1 && PyErr_Occurred()) return python_failed("register");
        if (token < 0) return static_cast<Status>(token);
        out = new LocalMD(token);
        return SUCCESS;
    }

    Status deregisterMem(BackendMD *md) override {
        auto *local = dynamic_cast<LocalMD *>(md);
        if (local == nullptr) return ERR_INVALID_PARAM;
        Status st;
        {
            Gil gil;
            st = call_status(py_, "deregister", Py_BuildValue("(l)", local->token));
        }
        delete local;
        return st;
    }

    Status connect(const std::string &agent) override {
        Gil gil;
        return call_status(py_, "connect", Py_BuildValue("(N)", str_of(agent)));
    }

    Status disconnect(const std::string &agent) override {
        Gil gil;
        return call_status(py_, "disconnect", Py_BuildValue("(N)", str_of(agent)));
    }

    Status unloadMD(BackendMD *md) override {
        delete md;
        return SUCCESS;
    }

    Status getPublicData(const BackendMD *md, std::string &out) const override {
        // A peer reaches our regions through our segment (the connection info) and checks
        // every range against it: the per-region blob only says whose it is.
        out = PLUGIN_NAME;
        return SUCCESS;
    }

    Status getConnInfo(std::string &out) const override {
        Gil gil;
        PyObject *res = PyObject_CallMethod(py_, "conn_info", nullptr);
        if (res == nullptr) return python_failed("conn_info");
        char *buf;
        Py_ssize_t n;
        if (PyBytes_AsStringAndSize(res, &buf, &n) < 0) {
            Py_DECREF(res);
            return python_failed("conn_info");
        }
        out.assign(buf, static_cast<size_t>(n));
        Py_DECREF(res);
        return SUCCESS;
    }

    Status loadRemoteConnInfo(const std::string &agent, const std::string &info) override {
        Gil gil;
        return call_status(py_, "load_remote_conn_info",
                           Py_BuildValue("(NN)", str_of(agent), bytes_of(info)));
    }

    Status loadRemoteMD(const BlobDesc &, const MemType &, const std::string &agent,
                        BackendMD *&out) override {
        Status st;
        {
            Gil gil;
            st = call_status(py_, "knows", Py_BuildValue("(N)", str_of(agent)));
        }
        if (st != SUCCESS) return st;
        out = new RemoteMD();
        return SUCCESS;
    }

    Status loadLocalMD(BackendMD *, BackendMD *&out) override {
        out = new RemoteMD();
        return SUCCESS;
    }

    Status prepXfer(const XferOp &op, const MetaDescList &local, const MetaDescList &remote,
                    const std::string &agent, BackendReqH *&handle,
                    const OptArgs *) const override {
        auto *req = new Request();
        Status st = pack(local, remote, req->triples);
        if (st == SUCCESS) st = prepare(op, agent, *req);
        if (st != SUCCESS) {
            delete req;
            return st;
        }
        handle = req;
        return SUCCESS;
    }

    Status postXfer(const XferOp &op, const MetaDescList &local, const MetaDescList &remote,
                    const std::string &agent, BackendReqH *&handle,
                    const OptArgs *opt) const override {
        auto *req = dynamic_cast<Request *>(handle);
        if (req == nullptr) return ERR_INVALID_PARAM;
        std::vector<uint64_t> now;
        Status st = pack(local, remote, now);
        if (st != SUCCESS) return st;
        if (now != req->triples) {  // posted with other descriptors than prepared
            req->triples.swap(now);
            st = prepare(op, agent, *req);
            if (st != SUCCESS) return st;
        }
        Gil gil;
        PyObject *notif = (opt != nullptr && opt->hasNotif) ? bytes_of(opt->notifMsg)
                                                            : (Py_INCREF(Py_None), Py_None);
        return call_status(py_, "post", Py_BuildValue("(ON)", req->xfer, notif));
    }

    Status checkXfer(BackendReqH *handle) const override {
        auto *req = dynamic_cast<Request *>(handle);
        if (req == nullptr) return ERR_INVALID_PARAM;
        Gil gil;
        return call_status(py_, "check", Py_BuildValue("(O)", req->xfer));
    }

    Status releaseReqH(BackendReqH *handle) const override {
        auto *req = dynamic_cast<Request *>(handle);
        if (req == nullptr) return ERR_INVALID_PARAM;
        Status st;
        {
            Gil gil;
            st = call_status(py_, "release", Py_BuildValue("(O)", req->xfer));
        }
        delete req;
        return st;
    }

    Status getNotifs(NotifList &out) override {
        Gil gil;
        PyObject *res = PyObject_CallMethod(py_, "notifs", nullptr);
        if (res == nullptr) return python_failed("notifs");
        Status st = SUCCESS;
        const Py_ssize_t n = PyList_Check(res) ? PyList_GET_SIZE(res) : -1;
        for (Py_ssize_t i = 0; i < n && st == SUCCESS; ++i) {
            PyObject *item = PyList_GET_ITEM(res, i);  // (agent: bytes, msg: bytes)
            char *a, *m;
            Py_ssize_t an, mn;
            if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2 ||
                PyBytes_AsStringAndSize(PyTuple_GET_ITEM(item, 0), &a, &an) < 0 ||
                PyBytes_AsStringAndSize(PyTuple_GET_ITEM(item, 1), &m, &mn) < 0) {
                st = ERR_BACKEND;
                break;
            }
            out.emplace_back(std::string(a, an), std::string(m, mn));
        }
        if (n < 0 || st != SUCCESS) {
            PyErr_Clear();
            fprintf(stderr, "mooncake_plugins NIXL backend: notifs returned a bad value\n");
            st = ERR_BACKEND;
        }
        Py_DECREF(res);
        return st;
    }

    Status genNotif(const std::string &agent, const std::string &msg) const override {
        Gil gil;
        return call_status(py_, "gen_notif", Py_BuildValue("(NN)", str_of(agent), bytes_of(msg)));
    }

  private:
    Status prepare(const XferOp &op, const std::string &agent, Request &req) const {
        Gil gil;
        PyObject *descs = PyBytes_FromStringAndSize(
            reinterpret_cast<const char *>(req.triples.data()),
            static_cast<Py_ssize_t>(req.triples.size() * sizeof(uint64_t)));
        PyObject *res = descs ? PyObject_CallMethod(py_, "prepare", "iNN", (int)op,
                                                    str_of(agent), descs)
                              : nullptr;
        if (res == nullptr) return python_failed("prepare");
        if (PyLong_Check(res)) {  // an error status: nothing prepared
            long v = PyLong_AsLong(res);
            Py_DECREF(res);
            return static_cast<Status>(v);
        }
        Py_XDECREF(req.xfer);
        req.xfer = res;
        return SUCCESS;
    }
};

BackendEngine *create_engine(const InitParams *p) {
    try {
        return new Engine(p);
    } catch (const std::exception &e) {
        fprintf(stderr, "mooncake_plugins NIXL backend: cannot create an engine: %s\n", e.what());
        return nullptr;
    }
}

void destroy_engine(BackendEngine *engine) { delete engine; }

const char *plugin_name() { return PLUGIN_NAME; }
const char *plugin_version() { return PLUGIN_VERSION; }

// Options NIXL lists for this backend (get_plugin_params); each is a string.
Params backend_options() {
    return {
        {"ip_addr", ""},     // address to serve on (default: NIXL_MOONCAKE_IP_ADDR, else
                             // the host's outgoing address, else 127.0.0.1)
        {"transports", ""},  // comma-separated engine transports (default: MC_TRANSPORTS or
                             // the engine's default: cuda_ipc, shm, tcp)
        {"mooncake_devices", ""},  // accepted for configs of NIXL's own Mooncake backend
    };
}

MemList backend_mems() { return {DRAM_SEG, VRAM_SEG}; }

Plugin plugin = {PLUGIN_API_VERSION, create_engine,  destroy_engine, plugin_name,
                 plugin_version,     backend_options, backend_mems};

}  // namespace

extern "C" {
__attribute__((visibility("default"))) Plugin *nixl_plugin_init() { return &plugin; }
__attribute__((visibility("default"))) void nixl_plugin_fini() {}
}

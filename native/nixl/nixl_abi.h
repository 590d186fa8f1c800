// Our own declarations of the part of NIXL's backend-plugin ABI that a backend touches.
//
// NIXL's wheels ship no headers, so these are written from its public interface
// (src/api/cpp/backend/*.h and nixl_types.h/nixl_descriptors.h of ai-dynamo/nixl) and
// checked against the 1.5.1 binaries: the base engine's vtable there has 27 slots in the
// order declared below (read from the relocations of _ZTV17nixlBackendEngine in the bundled
// plugins). What must match NIXL bit for bit:
//   - the order and signatures of BackendEngine's virtual functions (NIXL calls them
//     through the vtable);
//   - BackendEngine's data members (NIXL's core reads initErr, the type, the custom params
//     and the telemetry queue through inline accessors compiled into libnixl);
//   - the layouts of the structs NIXL hands us (InitParams, BlobDesc, MetaDesc, the
//     descriptor list, OptArgs) and of the Plugin table we hand back.
// Names are ours (namespace mcnixl); only layouts and the vtable reach NIXL.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mcnixl {

// -- enums (values as NIXL defines them) --------------------------------------------------
enum MemType : int { DRAM_SEG = 0, VRAM_SEG = 1, BLK_SEG = 2, OBJ_SEG = 3, FILE_SEG = 4 };
enum XferOp : int { NIXL_READ = 0, NIXL_WRITE = 1 };
enum Status : int {
    IN_PROG = 1,
    SUCCESS = 0,
    ERR_NOT_POSTED = -1,
    ERR_INVALID_PARAM = -2,
    ERR_BACKEND = -3,
    ERR_NOT_FOUND = -4,
    ERR_MISMATCH = -5,
    ERR_NOT_ALLOWED = -6,
    ERR_REPOST_ACTIVE = -7,
    ERR_UNKNOWN = -8,
    ERR_NOT_SUPPORTED = -9,
    ERR_REMOTE_DISCONNECT = -10,
    ERR_CANCELED = -11,
    ERR_NO_TELEMETRY = -12,
};
enum class ThreadSync : int { NONE = 0, STRICT = 1, RW = 2 };

using Params = std::unordered_map<std::string, std::string>;  // nixl_b_params_t
using MemList = std::vector<MemType>;                          // nixl_mem_list_t
using NotifList = std::vector<std::pair<std::string, std::string>>;  // notif_list_t

// -- what NIXL passes in ------------------------------------------------------------------
struct InitParams {  // nixlBackendInitParams
    std::string localAgent;
    std::string type;
    Params *customParams = nullptr;
    bool enableProgTh = false;
    uint64_t pthrDelay = 0;  // microseconds
    ThreadSync syncMode;
    bool enableTelemetry = false;
};

struct BasicDesc {  // nixlBasicDesc: no virtual functions, so no vptr
    uintptr_t addr;
    size_t len;
    uint64_t devId;
};

struct BlobDesc : BasicDesc {  // nixlBlobDesc
    std::string metaInfo;
};

class BackendMD {  // nixlBackendMD: the common base of a backend's metadata objects
  protected:
    bool isPrivate;

  public:
    explicit BackendMD(bool is_private) : isPrivate(is_private) {}
    virtual ~BackendMD() {}
};

class BackendReqH {  // nixlBackendReqH: the common base of a backend's request handles
  public:
    BackendReqH() {}
    virtual ~BackendReqH() {}
};

struct MetaDesc : BasicDesc {  // nixlMetaDesc
    BackendMD *metadata;
};

// nixlDescList<T>: a polymorphic class (virtual destructor) holding its memory type and a
// std::vector of descriptors. We only read it, through this same-layout view.
template <class T> struct DescListView {
    const void *vptr;
    MemType type;
    std::vector<T> descs;
};
using MetaDescList = DescListView<MetaDesc>;  // nixl_meta_dlist_t

struct OptArgs {  // nixlBackendOptionalArgs
    std::string notifMsg;
    bool hasNotif = false;
    std::string customParam;
};

struct TelemetryEvent {  // nixlTelemetryEvent
    uint32_t eventType;
    uint64_t value;
};

// -- the engine base class ----------------------------------------------------------------
class BackendEngine {  // nixlBackendEngine
  private:
    std::string backendType;
    Params customParams;
    std::vector<TelemetryEvent> telemetryEvents;
    std::mutex telemetryEventsMutex;

  protected:
    bool initErr = false;
    const std::string localAgent;
    const bool enableTelemetry;

    const Params &params() const { return customParams; }

  public:
    explicit BackendEngine(const InitParams *p)
        : backendType(p->type), customParams(*p->customParams), localAgent(p->localAgent),
          enableTelemetry(p->enableTelemetry) {}
    BackendEngine(const BackendEngine &) = delete;
    BackendEngine &operator=(const BackendEngine &) = delete;
    virtual ~BackendEngine() = default;

    // vtable slots, in NIXL's order
    virtual bool supportsRemote() const = 0;
    virtual bool supportsLocal() const = 0;
    virtual bool supportsNotif() const = 0;
    virtual MemList getSupportedMems() const = 0;
    virtual Status registerMem(const BlobDesc &mem, const MemType &kind, BackendMD *&out) = 0;
    virtual Status deregisterMem(BackendMD *md) = 0;
    virtual Status connect(const std::string &agent) = 0;
    virtual Status disconnect(const std::string &agent) = 0;
    virtual Status unloadMD(BackendMD *md) = 0;
    virtual Status prepXfer(const XferOp &op, const MetaDescList &local,
                            const MetaDescList &remote, const std::string &agent,
                            BackendReqH *&handle, const OptArgs *opt) const = 0;
    virtual Status postXfer(const XferOp &op, const MetaDescList &local,
                            const MetaDescList &remote, const std::string &agent,
                            BackendReqH *&handle, const OptArgs *opt) const = 0;
    virtual Status checkXfer(BackendReqH *handle) const = 0;
    virtual Status releaseReqH(BackendReqH *handle) const = 0;
    // memory views (remote list, then local list) and their release: not supported
    virtual Status prepMemViewRemote(const void *, void *&, const OptArgs *) const {
        return ERR_NOT_SUPPORTED;
    }
    virtual Status prepMemViewLocal(const void *, void *&, const OptArgs *) const {
        return ERR_NOT_SUPPORTED;
    }
    virtual void releaseMemView(void *) const {}
    virtual Status getPublicData(const BackendMD *md, std::string &out) const {
        return ERR_BACKEND;
    }
    virtual Status getConnInfo(std::string &out) const { return ERR_BACKEND; }
    virtual Status loadRemoteConnInfo(const std::string &agent, const std::string &info) {
        return ERR_BACKEND;
    }
    virtual Status loadRemoteMD(const BlobDesc &desc, const MemType &kind,
                                const std::string &agent, BackendMD *&out) {
        return ERR_BACKEND;
    }
    virtual Status loadLocalMD(BackendMD *in, BackendMD *&out) { return ERR_BACKEND; }
    virtual Status getNotifs(NotifList &out) { return ERR_BACKEND; }
    virtual Status genNotif(const std::string &agent, const std::string &msg) const {
        return ERR_BACKEND;
    }
    // queryMem(descs, responses) and estimateXferCost(...): not supported
    virtual Status queryMem(const void *, void *) const { return ERR_NOT_SUPPORTED; }
    virtual Status estimateXferCost(const void *, const void *, const void *, const void *,
                                    const void *, void *, void *, void *,
                                    const void *) const {
        return ERR_NOT_SUPPORTED;
    }
};

// -- the table nixl_plugin_init returns (nixlBackendPlugin) --------------------------------
constexpr int PLUGIN_API_VERSION = 1;

struct Plugin {
    int api_version;
    BackendEngine *(*create_engine)(const InitParams *);
    void (*destroy_engine)(BackendEngine *);
    const char *(*get_plugin_name)();
    const char *(*get_plugin_version)();
    Params (*get_backend_options)();
    MemList (*get_backend_mems)();
};

// layouts we can pin down without NIXL's headers (x86-64 / aarch64 LP64, libstdc++)
static_assert(sizeof(BasicDesc) == 24);
static_assert(sizeof(MetaDesc) == 32);
static_assert(offsetof(MetaDescList, descs) == 16);
static_assert(sizeof(TelemetryEvent) == 16);

}  // namespace mcnixl

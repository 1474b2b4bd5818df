/*
 * ascend-pd's own plain-C declaration of the HIXL client/server ("CS")
 * interface of libcann_hixl.so, as far as ascend-pd uses it.
 *
 * Written for ascend-pd; not a copy of any vendor file. Checked by hand,
 * declaration by declaration, against the hicann/hixl repository at tag
 * v9.1.0:
 *   include/cs/hixl_cs.h                    (functions, handles, codes,
 *                                            descriptor structs, enum)
 *   src/hixl/proxy/hcomm/hcomm_res_defs.h   (EndpointDesc, CommAddr,
 *                                            EndpointLoc, CommMem)
 *   docs/cpp/HIXL_CS接口.md                 (semantics)
 *
 * The vendor header is C++ (it includes <string> and gives struct members
 * default initialisers), so the bindings are generated from this file,
 * never from an installed hixl_cs.h. Layouts must stay identical to the
 * vendor's: ascend-sys checks every size below with bindgen's layout
 * tests and the emulator's static assertions.
 *
 * Differences that do not change the layout:
 *   - CommAddr's IPv4 / IPv6 members are declared as uint32_t and
 *     uint32_t[4] (network byte order), not struct in_addr / in6_addr, so
 *     no socket header is needed; both are 4 bytes aligned 4 and 16 bytes
 *     aligned 4 on Linux, as those structs are.
 *   - The descriptor structs carry no default values; callers zero them.
 */

#ifndef ASCEND_PD_HIXL_CS_H
#define ASCEND_PD_HIXL_CS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- from hcomm_res_defs.h ---- */

/* Transport an endpoint speaks. */
typedef enum {
    COMM_PROTOCOL_RESERVED = -1,
    COMM_PROTOCOL_HCCS = 0,
    COMM_PROTOCOL_ROCE = 1,
    COMM_PROTOCOL_PCIE = 2,
    COMM_PROTOCOL_SIO = 3,
    COMM_PROTOCOL_UBC_CTP = 4,
    COMM_PROTOCOL_UBC_TP = 5,
    COMM_PROTOCOL_UB_MEM = 6,
    COMM_PROTOCOL_UBOE = 7
} CommProtocol;

/* Which member of CommAddr's union is meant. */
typedef enum {
    COMM_ADDR_TYPE_RESERVED = -1,
    COMM_ADDR_TYPE_IP_V4 = 0,
    COMM_ADDR_TYPE_IP_V6 = 1,
    COMM_ADDR_TYPE_ID = 2,
    COMM_ADDR_TYPE_EID = 3
} CommAddrType;

/* 40 bytes: the type, then 36 bytes of address. */
typedef struct {
    CommAddrType type;
    union {
        uint8_t raws[36];
        uint32_t addr;     /* IPv4, network byte order */
        uint32_t addr6[4]; /* IPv6, network byte order */
        uint32_t id;
        uint8_t eid[16];
    };
} CommAddr;

/* Where an endpoint sits. */
typedef enum {
    ENDPOINT_LOC_TYPE_RESERVED = -1,
    ENDPOINT_LOC_TYPE_DEVICE = 0,
    ENDPOINT_LOC_TYPE_HOST = 1
} EndpointLocType;

/* 64 bytes: the location type, then 60 bytes that depend on it. */
typedef struct {
    EndpointLocType locType;
    union {
        uint8_t raws[60];
        struct {
            uint32_t devPhyId;
            uint32_t superDevId;
            uint32_t serverIdx;
            uint32_t superPodIdx;
        } device;
        struct {
            uint32_t id;
        } host;
    };
} EndpointLoc;

/* 160 bytes: one network endpoint of a device or host. */
typedef struct {
    CommProtocol protocol;
    CommAddr commAddr;
    EndpointLoc loc;
    union {
        uint8_t raws[52];
    };
} EndpointDesc;

/* Where a memory range lives. */
typedef enum {
    COMM_MEM_TYPE_INVALID = -1,
    COMM_MEM_TYPE_DEVICE = 0,
    COMM_MEM_TYPE_HOST = 1
} CommMemType;

/* 24 bytes: one memory range. */
typedef struct {
    CommMemType type;
    void *addr;
    uint64_t size;
} CommMem;

/* ---- from hixl_cs.h ---- */

typedef void *HixlServerHandle;
typedef void *HixlClientHandle;
typedef void *CompleteHandle;
typedef void *MemHandle;
typedef uint32_t HixlStatus;

#define HIXL_SUCCESS 0U
#define HIXL_PARAM_INVALID 103900U
#define HIXL_TIMEOUT 103901U
#define HIXL_FAILED 503900U

/* 128 bytes each; the configuration string may be NULL, the struct not. */
typedef struct HixlServerConfig {
    const char *global_resource_config;
    uint8_t reserved[120];
} HixlServerConfig;

typedef struct HixlClientConfig {
    const char *global_resource_config;
    uint8_t reserved[120];
} HixlClientConfig;

/* 128 bytes: whom a client talks to, through which endpoints. */
typedef struct HixlClientDesc {
    const EndpointDesc *local_endpoint;
    const EndpointDesc *remote_endpoint;
    const char *server_ip;
    uint32_t server_port;
    uint8_t tc;
    uint8_t sl;
    uint8_t reserved[98];
} HixlClientDesc;

/* 128 bytes: where a server listens and which endpoints it offers. */
typedef struct HixlServerDesc {
    const EndpointDesc *endpoint_list;
    const char *server_ip;
    uint32_t server_port;
    uint32_t endpoint_list_num;
    uint8_t reserved[104];
} HixlServerDesc;

/* One transfer of len bytes between a server address and a client address. */
typedef struct HixlOneSideOpDesc {
    void *remote_buf;
    void *local_buf;
    uint64_t len;
} HixlOneSideOpDesc;

typedef enum HixlCompleteStatus {
    HIXL_COMPLETE_STATUS_WAITING = 0,
    HIXL_COMPLETE_STATUS_COMPLETED = 1,
    HIXL_COMPLETE_STATUS_TIMEOUT = 2,
    HIXL_COMPLETE_STATUS_FAILED = 3
} HixlCompleteStatus;

/* Server side. */
HixlStatus HixlCSServerCreate(const HixlServerDesc *server_desc, const HixlServerConfig *config,
                              HixlServerHandle *server_handle);
HixlStatus HixlCSServerRegMem(HixlServerHandle server_handle, const char *mem_tag,
                              const CommMem *mem, MemHandle *mem_handle);
HixlStatus HixlCSServerListen(HixlServerHandle server_handle, uint32_t backlog);
HixlStatus HixlCSServerUnregMem(HixlServerHandle server_handle, MemHandle mem_handle);
HixlStatus HixlCSServerDestroy(HixlServerHandle server_handle);

/* Client side. */
HixlStatus HixlCSClientCreate(const HixlClientDesc *client_desc, const HixlClientConfig *config,
                              HixlClientHandle *client_handle);
HixlStatus HixlCSClientConnect(HixlClientHandle client_handle, uint32_t timeout_ms);
HixlStatus HixlCSClientGetRemoteMem(HixlClientHandle client_handle, CommMem **remote_mem_list,
                                    char ***mem_tag_list, uint32_t *list_num,
                                    uint32_t timeout_ms);
HixlStatus HixlCSClientRegMem(HixlClientHandle client_handle, const char *mem_tag,
                              const CommMem *mem, MemHandle *mem_handle);
HixlStatus HixlCSClientUnregMem(HixlClientHandle client_handle, MemHandle mem_handle);
HixlStatus HixlCSClientBatchPutAsync(HixlClientHandle client_handle, uint32_t list_num,
                                     const HixlOneSideOpDesc *desc_list,
                                     CompleteHandle *complete_handle);
HixlStatus HixlCSClientBatchGetAsync(HixlClientHandle client_handle, uint32_t list_num,
                                     const HixlOneSideOpDesc *desc_list,
                                     CompleteHandle *complete_handle);
HixlStatus HixlCSClientBatchPutSync(HixlClientHandle client_handle, uint32_t list_num,
                                    const HixlOneSideOpDesc *desc_list, uint32_t timeout_ms);
HixlStatus HixlCSClientBatchGetSync(HixlClientHandle client_handle, uint32_t list_num,
                                    const HixlOneSideOpDesc *desc_list, uint32_t timeout_ms);
HixlStatus HixlCSClientQueryCompleteStatus(HixlClientHandle client_handle,
                                           CompleteHandle complete_handle,
                                           HixlCompleteStatus *complete_status);
HixlStatus HixlCSClientDestroy(HixlClientHandle client_handle);

#ifdef __cplusplus
}
#endif

#endif /* ASCEND_PD_HIXL_CS_H */

/*
 * ascend-pd: our own declarations of the subset of HCCL (libhccl.so) that
 * ascend-pd calls: root-info communicator setup and the one-sided
 * (register / exchange / enable / batch put / batch get) API. Written from
 * the public HCCL API reference and the public CANN headers.
 *
 * Layout notes (see ascend-sys/README.md):
 * - HcclRootInfo is an opaque 4108-byte blob.
 * - HcclMemDesc is an opaque 512-byte blob. Public sources disagree on its
 *   inside (one char[512]; or u32 localRank, u32 remoteRank, char[504]);
 *   both are 512 bytes with byte alignment 4 at most, so we declare it as
 *   opaque bytes and never look inside on the real path.
 * - HcclEnableMemAccess writes an HcclMem (called CommMem in newer
 *   headers): { HcclMemType type; void *addr; uint64_t size; }.
 */
#ifndef ASCEND_PD_HCCL_H
#define ASCEND_PD_HCCL_H

#include <stdint.h>

#include "ascend_pd_acl.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Status of every HCCL call; 0 is success. Values as in CANN 8.5
 * (23, 24 and 1041 are new there; RESERVED moved from 23 to 1042). */
typedef enum {
    HCCL_SUCCESS = 0,
    HCCL_E_PARA = 1,
    HCCL_E_PTR = 2,
    HCCL_E_MEMORY = 3,
    HCCL_E_INTERNAL = 4,
    HCCL_E_NOT_SUPPORT = 5,
    HCCL_E_NOT_FOUND = 6,
    HCCL_E_UNAVAIL = 7,
    HCCL_E_SYSCALL = 8,
    HCCL_E_TIMEOUT = 9,
    HCCL_E_OPEN_FILE_FAILURE = 10,
    HCCL_E_TCP_CONNECT = 11,
    HCCL_E_ROCE_CONNECT = 12,
    HCCL_E_TCP_TRANSFER = 13,
    HCCL_E_ROCE_TRANSFER = 14,
    HCCL_E_RUNTIME = 15,
    HCCL_E_DRV = 16,
    HCCL_E_PROFILING = 17,
    HCCL_E_CCE = 18,
    HCCL_E_NETWORK = 19,
    HCCL_E_AGAIN = 20,
    HCCL_E_REMOTE = 21,
    HCCL_E_SUSPENDING = 22,
    HCCL_E_OPRETRY_FAIL = 23,
    HCCL_E_OOM = 24,
    HCCL_E_IN_STATUS = 1041,
    HCCL_E_RESERVED = 1042,
} HcclResult;

/* Element type of a transfer; counts are in elements of this type
 * (CANN 8.5 values; 13 is unused). */
typedef enum {
    HCCL_DATA_TYPE_INT8 = 0,
    HCCL_DATA_TYPE_INT16 = 1,
    HCCL_DATA_TYPE_INT32 = 2,
    HCCL_DATA_TYPE_FP16 = 3,
    HCCL_DATA_TYPE_FP32 = 4,
    HCCL_DATA_TYPE_INT64 = 5,
    HCCL_DATA_TYPE_UINT64 = 6,
    HCCL_DATA_TYPE_UINT8 = 7,
    HCCL_DATA_TYPE_UINT16 = 8,
    HCCL_DATA_TYPE_UINT32 = 9,
    HCCL_DATA_TYPE_FP64 = 10,
    HCCL_DATA_TYPE_BFP16 = 11,
    HCCL_DATA_TYPE_INT128 = 12,
    HCCL_DATA_TYPE_HIF8 = 14,
    HCCL_DATA_TYPE_FP8E4M3 = 15,
    HCCL_DATA_TYPE_FP8E5M2 = 16,
    HCCL_DATA_TYPE_FP8E8M0 = 17,
    HCCL_DATA_TYPE_RESERVED = 255,
} HcclDataType;

/* Where registered memory lives. */
typedef enum {
    HCCL_MEM_TYPE_DEVICE = 0,
    HCCL_MEM_TYPE_HOST = 1,
    HCCL_MEM_TYPE_NUM = 2,
} HcclMemType;

/* Opaque communicator handle. */
typedef void *HcclComm;

#define HCCL_ROOT_INFO_BYTES 4108

/* Rendezvous blob made by rank 0 and handed to every rank out of band. */
typedef struct HcclRootInfoDef {
    char internal[HCCL_ROOT_INFO_BYTES];
} HcclRootInfo;

#define HCCL_MEM_DESC_BYTES 512

/* Opaque description of one registered memory region. */
typedef struct {
    char desc[HCCL_MEM_DESC_BYTES];
} HcclMemDesc;

/* A caller-owned array of descriptors. */
typedef struct {
    HcclMemDesc *array;
    uint32_t arrayLength;
} HcclMemDescs;

/* A memory range: where it lives, its address and its size in bytes. */
typedef struct {
    HcclMemType type;
    void *addr;
    uint64_t size;
} HcclMem;

/* One element of a batch put/get: count elements of dataType. */
typedef struct {
    void *localAddr;
    void *remoteAddr;
    uint64_t count;
    HcclDataType dataType;
} HcclOneSideOpDesc;

/* Communicator setup. */
HcclResult HcclGetRootInfo(HcclRootInfo *rootInfo);
HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank,
                                HcclComm *comm);
HcclResult HcclCommDestroy(HcclComm comm);
const char *HcclGetErrorString(HcclResult code);

/* One-sided API (absent in older CANN releases; loaded as optional). */
HcclResult HcclRegisterMem(HcclComm comm, uint32_t remoteRank, int type, void *addr,
                           uint64_t size, HcclMemDesc *desc);
HcclResult HcclDeregisterMem(HcclComm comm, HcclMemDesc *desc);
HcclResult HcclExchangeMemDesc(HcclComm comm, uint32_t remoteRank, HcclMemDescs *local,
                               int timeout, HcclMemDescs *remote, uint32_t *actualNum);
HcclResult HcclEnableMemAccess(HcclComm comm, HcclMemDesc *remoteMemDesc, HcclMem *remoteMem);
HcclResult HcclDisableMemAccess(HcclComm comm, HcclMemDesc *remoteMemDesc);
HcclResult HcclBatchPut(HcclComm comm, uint32_t remoteRank, HcclOneSideOpDesc *desc,
                        uint32_t descNum, aclrtStream stream);
HcclResult HcclBatchGet(HcclComm comm, uint32_t remoteRank, HcclOneSideOpDesc *desc,
                        uint32_t descNum, aclrtStream stream);

#ifdef __cplusplus
}
#endif

#endif /* ASCEND_PD_HCCL_H */

/*
 * ascend-pd: our own declarations of the HCCL one-sided API (libhcomm.so
 * from CANN 8.5, reachable through libhccl.so), where CANN 8.5 installs
 * them: pkg_inc/hccl/hccl_one_sided_services.h. As there, HcclMem and
 * HcclMemType come from "hccl_mem_defs.h", which CANN 8.5 does not install;
 * the generator supplies its own copy (ascend-sys/gen/shim) when the
 * install lacks one, and this tree deliberately lacks one too.
 *
 * HcclMemDesc is opaque (512 bytes); public sources disagree on its inside
 * and ascend-pd never looks into it on the real path.
 */
#ifndef ASCEND_PD_HCCL_ONE_SIDED_SERVICES_H
#define ASCEND_PD_HCCL_ONE_SIDED_SERVICES_H

#include <stdint.h>

#include <acl/acl.h>
#include <hccl/hccl_types.h>
#include "hccl_mem_defs.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HCCL_MEM_DESC_LENGTH 511

/* Opaque description of one registered memory region. */
typedef struct {
    char desc[HCCL_MEM_DESC_LENGTH + 1];
} HcclMemDesc;

/* A caller-owned array of descriptors. */
typedef struct {
    HcclMemDesc *array;
    uint32_t arrayLength;
} HcclMemDescs;

/* One element of a batch put/get: count elements of dataType. */
typedef struct {
    void *localAddr;
    void *remoteAddr;
    uint64_t count;
    HcclDataType dataType;
} HcclOneSideOpDesc;

/* Absent in CANN releases without the one-sided API; loaded as optional.
 * One batch call takes at most 256 ops (64 on Ascend 950); a communicator
 * at most 256 registrations. */
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

#endif /* ASCEND_PD_HCCL_ONE_SIDED_SERVICES_H */

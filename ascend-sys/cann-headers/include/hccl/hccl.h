/*
 * ascend-pd: our own declarations of the HCCL communicator functions
 * ascend-pd calls (libhccl.so), where CANN has them (include/hccl/hccl.h).
 * HcclRootInfo is an opaque 4108-byte blob.
 */
#ifndef ASCEND_PD_HCCL_H
#define ASCEND_PD_HCCL_H

#include <acl/acl.h>
#include <hccl/hccl_types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Communicator setup. */
HcclResult HcclGetRootInfo(HcclRootInfo *rootInfo);
HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank,
                                HcclComm *comm);
HcclResult HcclCommDestroy(HcclComm comm);
const char *HcclGetErrorString(HcclResult code);

#ifdef __cplusplus
}
#endif

#endif /* ASCEND_PD_HCCL_H */

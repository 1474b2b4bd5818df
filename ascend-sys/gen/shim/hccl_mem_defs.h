/*
 * ascend-pd's own hccl_mem_defs.h, for CANN 8.5 installs: their
 * pkg_inc/hccl/hccl_one_sided_services.h includes this file but the
 * package does not install it. Used by ascend-sys-gen only when the
 * headers it reads have none. Layout as CANN's HcclMem (CommMem in newer
 * releases): { HcclMemType type; void *addr; uint64_t size; }.
 */
#ifndef ASCEND_PD_HCCL_MEM_DEFS_H
#define ASCEND_PD_HCCL_MEM_DEFS_H

#include <stdint.h>

/* Where registered memory lives. */
typedef enum {
    HCCL_MEM_TYPE_DEVICE = 0,
    HCCL_MEM_TYPE_HOST = 1,
    HCCL_MEM_TYPE_NUM = 2,
} HcclMemType;

/* A memory range: where it lives, its address and its size in bytes. */
typedef struct {
    HcclMemType type;
    void *addr;
    uint64_t size;
} HcclMem;

#endif /* ASCEND_PD_HCCL_MEM_DEFS_H */

/* Memory history of the allocator, for torch's memory snapshots: a ring of
 * trace records per device (alloc, free requested, free completed, segment
 * alloc and free, out of memory) and the enumeration of segments and their
 * blocks. Each block and record carries its tag (checkpoint region and
 * phase) and, when the caller asked for stacks, an opaque context.
 *
 * Contexts: the caller's (torch's gathered stack, through the adapter).
 * The allocator holds references through the caller's retain and release
 * callbacks: one per block that carries it, one per record, one per
 * snapshot entry. gather() is called without any allocator lock held (it
 * may take the GIL); release() may be called with a device lock held and
 * must not wait for anything that waits for the allocator (torch's
 * CapturedTraceback defers its Python frames).
 *
 * Thread-safety: any function from any thread. Units: bytes; times are
 * the caller's clock() values. */
#ifndef MATEPOINT_ALLOC_HISTORY_H
#define MATEPOINT_ALLOC_HISTORY_H

#include "alloc.h"

#include <stdint.h>
#include <string.h>

/* torch's TraceEntry actions, in its order */
enum {
    ALLOC_TRACE_ALLOC, ALLOC_TRACE_FREE_REQUESTED, ALLOC_TRACE_FREE_COMPLETED,
    ALLOC_TRACE_SEGMENT_ALLOC, ALLOC_TRACE_SEGMENT_FREE, ALLOC_TRACE_OOM = 8
};
/* torch's names of its TraceEntry actions (its skip_actions list), by
 * value; matepoint records none past those above but accepts every name. */
enum { ALLOC_TRACE_ACTIONS = 10 };

/* The action named `name`, or -1 for a name torch does not know. */
static inline int
alloc_trace_action(const char *name)
{
    static const char *const names[ALLOC_TRACE_ACTIONS] = {
        "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
        "segment_map", "segment_unmap", "snapshot", "oom", "annotate"};
    for (int action = 0; action < ALLOC_TRACE_ACTIONS; action++) {
        if (strcmp(names[action], name) == 0)
            return action;
    }
    return -1;
}

/* gather()'s tag for an event of no block (a free's own stack) */
#define ALLOC_TAG_NONE UINT64_MAX

/* torch's RecordContext: which events keep a stack */
enum { ALLOC_CONTEXT_NEVER, ALLOC_CONTEXT_STATE, ALLOC_CONTEXT_ALLOC, ALLOC_CONTEXT_ALL };

typedef struct {
    int enabled;                /* 0: no records are made, and those made are dropped */
    uint64_t max_entries;       /* records kept per device (at least 1), the oldest
                                 * dropped; the ring grows as records come */
    int when;                   /* ALLOC_CONTEXT_*: which events gather a context */
    int clear;                  /* drop the records made so far */
    uint32_t skip;              /* actions not recorded: bit (1 << ALLOC_TRACE_*) each */
    /* a new context for an event of an allocation tagged `tag`, one
     * reference (NULL: none); called for every block while enabled,
     * whatever `when` says (it carries the tag), with stacks if `when` */
    void *(*gather)(uint64_t tag);
    void (*retain)(void *context);
    void (*release)(void *context);
    int64_t (*clock)(void);     /* a record's time; NULL: 0 */
} alloc_history_config;

typedef struct {
    int action;                 /* ALLOC_TRACE_* */
    uint64_t address;           /* OOM: the device's free bytes */
    uint64_t size;              /* a block's: the bytes requested (torch's orig_size);
                                 * OOM: the request rounded; a segment's: its size */
    void *stream;
    uint64_t pool_a, pool_b;    /* the private pool of the memory; (0, 0): the ordinary cache */
    uint64_t tag;
    void *context;              /* NULL or one reference */
    int64_t time;
} alloc_trace_record;

enum { ALLOC_BLOCK_INACTIVE, ALLOC_BLOCK_ALLOCATED, ALLOC_BLOCK_PENDING_FREE };

typedef struct {
    uint64_t address, size, requested;
    int state;                  /* ALLOC_BLOCK_* */
    uint64_t tag;
    void *context;              /* NULL or one reference */
} alloc_block_record;

typedef struct {
    uint64_t address, size;
    void *stream;
    int small;                  /* the small pool's */
    uint64_t pool_a, pool_b;    /* the private pool owning it; (0, 0): the ordinary cache */
    uint64_t first_block, block_count;   /* its blocks in alloc_snapshot.blocks */
} alloc_segment_record;

typedef struct {
    alloc_segment_record *segments;
    uint64_t segment_count;
    alloc_block_record *blocks;
    uint64_t block_count;
    alloc_trace_record *trace; /* oldest first */
    uint64_t trace_count;
    void (*release)(void *context);   /* what alloc_snapshot_free releases with */
} alloc_snapshot;

/* Starts, changes or stops recording (torch's recordHistory). */
void alloc_history_configure(allocator *a, const alloc_history_config *config);
/* 1 while recording (torch's isHistoryEnabled). */
int alloc_history_enabled(allocator *a);
/* The context the live block at `ptr` (its start) was allocated with,
 * one reference the caller gives back with the history's release (torch's
 * getContextForPointer); NULL for none, or no such block. */
void *alloc_block_context(allocator *a, void *ptr);
/* The segments, blocks and records of `device`, holding references to
 * their contexts; 0, or -1 without memory (then `out` is empty). The
 * caller frees it with alloc_snapshot_free. */
int alloc_take_snapshot(allocator *a, int device, alloc_snapshot *out);
/* The same, of the segments of private pool (pool_a, pool_b) only ((0, 0):
 * all, as alloc_take_snapshot); the trace is the device's whole. */
int alloc_take_pool_snapshot(allocator *a, int device, uint64_t pool_a, uint64_t pool_b,
                             alloc_snapshot *out);
void alloc_snapshot_free(allocator *a, alloc_snapshot *snapshot);

#endif

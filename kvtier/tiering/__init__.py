"""Tiering: where each page lives, who holds it, and moving pages between the tiers.

Modules, bottom up:

    eviction      per tier and layer group: lowest priority, then least recently used, O(1)
    tier          a tier at run time: its storage, slot owners, eviction index, disk rows, copies
    sizing        a tier's byte quota split across layer groups
    build         the run-time tiers from the configured ones (the disk tier opened first)
    disk_restore  the reuse tree rebuilt from a disk tier's index on start (every row checked)
    disk_speed    a disk's read speed sampled at open when no load has measured it yet
    plan          ``MovePlan``: the copies an operation still has to perform
    duplex        the parts in which a demotion and a promotion (or a swap) share the link
    residency     who holds which page: holds, locks, publication, freeing and dropping
    disk_writes   what goes to the disk tier (demotions, ancestors' copies, persist), through a
                  ``DiskWriter`` handed in
    swap_scratch  device scratch through which a small swap's victims pass (no head start)
    planner       what to move: making room (the demotion cascade), promotion, a plan's bookkeeping
    mover         copies a plan's data, one copier call per edge or per part; the pool's ``DiskWriter``
    load_cost     load or recompute: measured tier bandwidths against the prefill rate
    background    ``maintain``'s plans: write-through copies to host, the primary free reserve
    host_prefetch disk -> host reads on a background thread, landed by the pool
    disk_write_behind  copies of the coldest host pages written to disk on a background thread
"""

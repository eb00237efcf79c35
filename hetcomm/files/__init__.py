"""Files that survive a crash mid-write and prove their own content: the primitives
under every checkpoint hetcomm writes (hetcomm.loop's run checkpoints, hetcomm.shard's
ranges of sharded state). Below both: it knows tensors and files, not runs or ranks."""

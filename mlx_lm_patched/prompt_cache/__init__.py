"""The prompt cache servers keep: shared prefix blocks, the store, ring
checkpoints, cache files, copies on the host, and the disk tier (directory,
block files, writer)."""

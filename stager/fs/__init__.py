"""OS mechanics with no dataset concepts: atomic publish and partial names, the verified copy engine,
write-back and the libc calls behind it, file-system detection, Lustre's ``lfs``, the node lock."""

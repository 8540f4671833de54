"""The constants of rlexact's keyed integer hashes (lowbias32 rounds over uint32), shared by the torch twin
(:mod:`rlexact.rollout.keyed_hash`) and the Triton kernels (:mod:`rlexact.ops.keyed_noise`). No Triton import."""

MASK32 = 0xFFFFFFFF
"""32-bit mask of the hash arithmetic (held in int64 on the host)."""
C1 = 0x7FEB352D
"""First lowbias32 multiplier."""
C2 = 0x846CA68B
"""Second lowbias32 multiplier."""
ROW_SALT = 0x9E3779B9
"""Salt of the first and last row-key rounds."""

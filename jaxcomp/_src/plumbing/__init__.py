"""Plumbing: exact arithmetic, bit packing, random bits, tree helpers, profile
scopes, the collectives of a traced program, checkpoint keys. Imports nothing above it
(the kernels import it)."""

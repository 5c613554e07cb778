"""Plumbing: exact arithmetic, bit packing, random bits, tree helpers, profile
scopes, checkpoint keys. Imports nothing above it (the kernels import it)."""

"""Exchanges: the collective primitives (``collectives``), the pipeline that routes every
leaf through them (``pipeline``), and the exchanges of their own (MIPD's, FSDP's, qwZ's).
Import codecs and plumbing."""

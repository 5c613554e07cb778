"""Codecs: pure encode/decode pairs whose payloads cross the wire (``base``: the
``Codec`` interface and the fixed-width codecs), and their host-side formats. Import
plumbing and the kernels only."""

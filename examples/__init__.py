"""Examples of data-parallel training with jaxcomp compressors."""

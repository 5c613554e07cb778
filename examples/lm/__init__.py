"""A byte-level transformer language model: dense vs compressed gradient exchange."""

"""Private implementation of jaxcomp; import from :mod:`jaxcomp` instead."""

"""jaxcomp."""

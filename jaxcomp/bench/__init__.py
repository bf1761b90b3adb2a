"""Benchmarks: ``python -m jaxcomp.bench <subcommand>`` (see ``__main__``)."""

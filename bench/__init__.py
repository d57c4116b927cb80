"""The benchmark suite: each module is one benchmark (``python -m bench.NAME``), run from the
repository root; ``python -m bench`` is the one runner (``list``, ``run NAME``, ``all``).
docs/benchmarks/README.md holds the goals and the current result of each."""

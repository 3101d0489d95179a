"""kvruntime's tools: ``bench`` and ``selftest`` (run by ``python -m kvruntime``), the process
roles they spawn (``roles``: a prefill process serving a cache, a push on command), the bounce
ring's own bench (``python -m kvruntime.tools.bench_bounce``), and what the benches share
(``workload``, ``references``). The library never imports this package."""

"""The serving harness: a system's OpenAI-compatible server, started and stopped by the run.

- serve.py: `mode=serve`, one server on the model until SIGTERM.
- workload.py: `workload=serving`, the server driven by guidellm at levels of load, one record per level.
- guidellm_main.py: guidellm's command line with its Poisson schedule's origin set before its workers start.
- rate_search.py: the highest Poisson rate within latency limits (pure logic, tested on injected measurements).
- aiperf.py: the second load generator, aiperf (its own environment), run for per-token times.
- itl.py: ITL percentiles from those times and from the server's /metrics histogram (pure logic).
- process.py: the one place that starts and stops the run's child processes (servers, the load generator).
- api_key.py: serve.api_key, kept out of command lines and records.

Nothing is imported here: `runners.main` reads api_key.py at start, the rest loads when a serving run asks."""

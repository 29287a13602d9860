"""The benchmark harness: Hydra schema, workloads, timing, records, tables (see README)."""
from runners import cli_help, hardware, schema

schema.register()
hardware.register_resolver()
cli_help.register_resolver()

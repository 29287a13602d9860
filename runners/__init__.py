"""The benchmark harness: Hydra schema, workloads, timing, records, tables (see README)."""
from runners import cli_help, detect, schema

schema.register()
detect.register_resolver()
cli_help.register_resolver()

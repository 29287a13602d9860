"""The benchmark harness: Hydra schema, workloads, timing, records, tables (see README)."""
from runners import detect, schema

schema.register()
detect.register_resolver()

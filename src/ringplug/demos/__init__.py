"""Self-contained demos: data generated on the fly and small models, for examples and
benchmarks that must run without downloads."""

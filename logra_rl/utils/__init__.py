"""Small shared helpers: config structs, checkpoints, metrics sinks, memory probes."""
